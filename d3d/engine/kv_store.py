"""Size-bounded LRU stores of KV caches, and the target's prompt-prefix cache.

:class:`BoundedLru` holds items under string keys, each with its size in bytes, and evicts the
least recently used while it holds more than ``max_entries`` items or ``max_bytes`` bytes; an
item larger than the whole store is not kept. The document cache of compression
(:class:`compression.doc_cache.DocumentCache`) and :class:`PrefixCache` are two uses.

:class:`PrefixCache` keeps the target's KV cache for prompt prefixes that several requests share
(document QA: the chat header, the instruction and the document's head, which every question
about a document keeps). A request names how many of its first prompt tokens form such a prefix;
the target then prefills in two pieces, the prefix (or a copy of its cached KV) and the rest, so
every request that names the same prefix computes the same numbers whether or not it hit the
cache. Entries are shared, not copied: a decode appends by concatenation and rolls back by
slicing, neither of which writes into the stored tensors.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, TypeVar

from transformers import DynamicCache

T = TypeVar("T")


def content_key(tag: str, *runs: Sequence[int]) -> str:
    """SHA-256 of a tag and token-id runs (a text's identity for one reader or model)."""
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


def copy_cache(cache: DynamicCache) -> DynamicCache:
    """A new cache holding the same keys and values (appending to it leaves ``cache`` as it was)."""
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys, layer.values, i)
    return out


class BoundedLru(Generic[T]):
    """Size-bounded LRU by key (see the module docstring); thread-safe."""

    def __init__(self, max_bytes: int = 1 << 30, max_entries: int = 16):
        if max_bytes < 1 or max_entries < 1:
            raise ValueError("a cache needs room for at least one entry")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._items: OrderedDict[str, T] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> T | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def keeps(self, size: int) -> bool:
        """Whether an item of ``size`` bytes would be kept (one larger than the store is not)."""
        return size <= self.max_bytes

    def put_sized(self, key: str, item: T, size: int) -> None:
        with self._lock:
            if not self.keeps(size):
                return
            self._items.pop(key, None)
            self._items[key] = item
            self._bytes[key] = size
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


class PrefixCache(BoundedLru[DynamicCache]):
    """The target's KV for shared prompt prefixes, keyed by their token ids. ``max_bytes``: the
    engine sizes it from the memory there is (:func:`d3d.model.memory.prefix_cache_bytes`); the
    default here suits tests and tiny models."""

    def __init__(self, max_bytes: int = 256 << 20, max_entries: int = 64, tag: str = "target"):
        super().__init__(max_bytes, max_entries)
        self.tag = tag

    def key(self, ids: Sequence[int]) -> str:
        return content_key(self.tag, ids)

    def lookup(self, ids: Sequence[int]) -> DynamicCache | None:
        """A fresh cache holding the stored KV of ``ids`` (shared tensors), or None."""
        return self.lookup_key(self.key(ids))

    def lookup_key(self, key: str) -> DynamicCache | None:
        """:meth:`lookup` by the prefix's :meth:`key`."""
        stored = self.get(key)
        return None if stored is None else copy_cache(stored)

    def store(self, ids: Sequence[int], cache: DynamicCache) -> None:
        """Keep ``cache`` (which holds exactly ``ids``) under ``ids``, as a snapshot."""
        snap = copy_cache(cache)
        self.put_sized(self.key(ids), snap, cache_bytes(snap))
