"""The document cache: the drafter's pass over a document, kept for the next question.

Scoring a prompt costs one document pass (``prefix + context`` through the reader's layers)
and one small query pass per question. The document pass depends on the document only, so a
:class:`DocumentReading` (one KV cache per reading window) is stored under a content hash of
the reader's settings and the prefix and context token ids; a second question about the same
document skips straight to its query pass. At full depth (the drafter's own layers, not an
int8 copy, one window) the reading is also the drafter's prefill of the full prompt, which
drafting can start from (``drafter_cache``).

:class:`DocumentCache` is a size-bounded LRU in memory (``max_bytes`` of KV tensors). Entries
are shared, not copied: a query pass appends to a window's cache and cuts its own KV off again,
so readers of one entry must not run at the same time (the owner, :class:`compression.qa.
DocumentQA`, serialises them with a lock).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from transformers import DynamicCache


def content_key(tag: str, *runs: Sequence[int]) -> str:
    """SHA-256 of a reader tag and token-id runs (the document's identity for a reader)."""
    h = hashlib.sha256(tag.encode())
    for run in runs:
        h.update(b"|")
        h.update(",".join(map(str, run)).encode())
    return h.hexdigest()


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by a cache's key and value tensors."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


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


class DocumentCache:
    """Size-bounded LRU of :class:`DocumentReading` by key (see the module docstring)."""

    def __init__(self, max_bytes: int = 1 << 30, max_entries: int = 16):
        if max_bytes < 1 or max_entries < 1:
            raise ValueError("a document cache needs room for at least one entry")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._items: OrderedDict[str, DocumentReading] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> DocumentReading | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def put(self, reading: DocumentReading) -> None:
        size = reading.nbytes
        with self._lock:
            if size > self.max_bytes:
                return  # larger than the whole cache: not kept
            self._items.pop(reading.key, None)
            self._items[reading.key] = reading
            self._bytes[reading.key] = size
            while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
                old, _ = self._items.popitem(last=False)
                del self._bytes[old]

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes.clear()

    def stats(self) -> dict:
        return {
            "entries": len(self),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
        }
