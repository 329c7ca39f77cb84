"""The document cache: the drafter's pass over a document, kept for the next question.

Scoring a prompt costs one document pass (``prefix + context`` through the reader's layers)
and one small query pass per question. The document pass depends on the document only, so a
:class:`DocumentReading` (one KV cache per reading window) is stored under a content hash of
the reader's settings and weights and the prefix and context token ids; a second question
about the same document skips straight to its query pass. At full depth (the drafter's own
layers, not an int8 copy, one window) the reading is also the drafter's prefill of the full
prompt, which drafting can start from (``drafter_cache``).

:class:`DocumentCache` is a size-bounded LRU in memory (``max_bytes`` of KV tensors), with an
optional disk tier (``directory``): every reading put in memory is also written there (one
file per key, written beside the work in a thread and renamed into place, so a reader never
sees half a file), a memory miss looks there before reading the document again, and the
directory is kept under ``max_disk_bytes`` by dropping the least recently used files. The files
hold a document's token ids: the folder is made (or narrowed to) mode 0700 and every file 0600,
created new (``O_EXCL``, no symlink followed); a write that fails removes its temporary file, and
opening the cache removes those a killed writer left (their process is gone). The disk
tier lets a later process (the next ``d3d qa``, a restarted service) skip the reading; keys
name the reader's weights, not the process, so a file is only ever read back by the same reader.

Entries are shared, not copied: a query pass appends to a window's cache and cuts its own KV
off again, so readers of one entry must not run at the same time (the owner,
:class:`compression.qa.DocumentQA`, serialises them with a lock).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import DynamicCache

from d3d.engine.kv_store import BoundedLru, cache_bytes, content_key

__all__ = ["DocumentCache", "DocumentReading", "WindowCache", "cache_bytes", "content_key"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowCache:
    """The document pass over context tokens ``[start, end)`` (after the prefix)."""

    start: int
    end: int
    cache: DynamicCache


@dataclass(frozen=True)
class DocumentReading:
    """One document's pass through the reader: a cache per window, and what it read."""

    key: str
    prefix: tuple[int, ...]
    context: tuple[int, ...]
    windows: tuple[WindowCache, ...]
    drafter_cache: bool = False

    def with_drafter_cache(self, full_depth: bool) -> DocumentReading:
        """Mark the reading as the drafter's own prefill (full depth, one window)."""
        return replace(self, drafter_cache=full_depth and len(self.windows) == 1)

    @property
    def nbytes(self) -> int:
        return sum(cache_bytes(w.cache) for w in self.windows)

    @property
    def ids(self) -> list[int]:
        """The token ids the reading covers: prefix + context."""
        return [*self.prefix, *self.context]

    # -- on disk -------------------------------------------------------------------------------
    def to_state(self) -> dict:
        """Plain tensors and numbers (``torch.save`` with ``weights_only`` loading)."""
        return {
            "key": self.key,
            "prefix": torch.tensor(self.prefix, dtype=torch.long),
            "context": torch.tensor(self.context, dtype=torch.long),
            "drafter_cache": self.drafter_cache,
            "windows": [
                {
                    "start": w.start,
                    "end": w.end,
                    "keys": [layer.keys for layer in w.cache.layers],
                    "values": [layer.values for layer in w.cache.layers],
                }
                for w in self.windows
            ],
        }

    @classmethod
    def from_state(cls, state: dict) -> DocumentReading:
        wins = []
        for w in state["windows"]:
            cache = DynamicCache()
            for i, (k, v) in enumerate(zip(w["keys"], w["values"], strict=True)):
                cache.update(k, v, i)
            wins.append(WindowCache(int(w["start"]), int(w["end"]), cache))
        return cls(
            state["key"],
            tuple(state["prefix"].tolist()),
            tuple(state["context"].tolist()),
            tuple(wins),
            bool(state["drafter_cache"]),
        )


class DocumentCache(BoundedLru[DocumentReading]):
    """Size-bounded LRU of :class:`DocumentReading` by key, optionally on disk too (see the
    module docstring)."""

    def __init__(
        self,
        max_bytes: int = 1 << 30,
        max_entries: int = 16,
        directory: str | Path | None = None,
        max_disk_bytes: int = 8 << 30,
    ):
        super().__init__(max_bytes, max_entries)
        self.directory = Path(directory) if directory is not None else None
        self.max_disk_bytes = max_disk_bytes
        self.disk_hits = 0
        self._writes: list[threading.Thread] = []
        if self.directory is not None:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.directory.stat().st_uid == os.getuid():
                self.directory.chmod(0o700)  # token ids: this user's alone
            self._remove_stale()

    def _remove_stale(self) -> None:
        """Temporary files of writers that were killed (``KEY.PID.TID.tmp``, PID gone)."""
        assert self.directory is not None
        for p in self.directory.glob("*.tmp"):
            parts = p.name.split(".")
            pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
            if pid is None or not _alive(pid):
                p.unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{key}.pt"

    def __contains__(self, key: str) -> bool:
        on_disk = self.directory is not None and self._path(key).is_file()
        return super().__contains__(key) or on_disk

    def get(self, key: str) -> DocumentReading | None:
        hit = super().get(key)
        if hit is not None or self.directory is None:
            return hit
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            reading = DocumentReading.from_state(torch.load(path, weights_only=True))
        except Exception:  # a damaged or foreign file: read the document again
            log.warning("ignoring unreadable document-cache file %s", path, exc_info=True)
            return None
        if reading.key != key:
            return None
        os.utime(path)  # recently used: the last to go when the directory is trimmed
        self.disk_hits += 1
        self.put_sized(key, reading, reading.nbytes)
        return reading

    def put(self, reading: DocumentReading) -> None:
        self.put_sized(reading.key, reading, reading.nbytes)
        if self.directory is not None and not self._path(reading.key).is_file():
            # The state is taken here, not in the thread: query passes append to a window's cache
            # and crop it again (new tensors each time, never in place), so the references taken
            # now stay the document pass while the file is written. Not a daemon: a process that
            # ends right after its answer still finishes the file.
            state = reading.to_state()
            t = threading.Thread(
                target=self._write, args=(reading.key, state), name="doc-cache-write"
            )
            self._writes = [w for w in self._writes if w.is_alive()] + [t]
            t.start()

    def _write(self, key: str, state: dict) -> None:
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            log.warning("could not write the document cache file %s", path, exc_info=True)
            return
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
            os.replace(tmp, path)
            self._trim()
        except Exception:  # a full disk, a bad tensor: no file, and no temporary file left
            log.warning("could not write the document cache file %s", path, exc_info=True)
            tmp.unlink(missing_ok=True)

    def _trim(self) -> None:
        assert self.directory is not None
        files = sorted(self.directory.glob("*.pt"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files[:-1]:  # the newest file always stays
            if total <= self.max_disk_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait for the files being written."""
        for t in self._writes:
            t.join()
        self._writes = []

    def clear_disk(self) -> None:
        """Remove the files (:meth:`clear` empties the memory tier only)."""
        self.flush()
        if self.directory is not None:
            for p in self.directory.glob("*.pt"):
                p.unlink(missing_ok=True)

    def stats(self) -> dict:
        out = super().stats()
        if self.directory is not None:
            out["disk_hits"] = self.disk_hits
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
