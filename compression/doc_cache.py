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

from dataclasses import dataclass, replace

from transformers import DynamicCache

from d3d.kv_store import BoundedLru, cache_bytes, content_key

__all__ = ["DocumentCache", "DocumentReading", "WindowCache", "cache_bytes", "content_key"]


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


class DocumentCache(BoundedLru[DocumentReading]):
    """Size-bounded LRU of :class:`DocumentReading` by key (see the module docstring)."""

    def put(self, reading: DocumentReading) -> None:
        self.put_sized(reading.key, reading, reading.nbytes)
