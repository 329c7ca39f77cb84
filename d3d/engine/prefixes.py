"""Prompt prefixes that requests share: read once, kept in the prefix cache, copied after.

A request may name how many of its first prompt tokens other requests share
(``GenRequest.shared_prefix``; document QA names the instruction and the document's head, or the
whole document when nothing is cut). The scheduler reads such a prefix on its own, up to its
end, and keeps its KV in the :class:`~d3d.engine.kv_store.PrefixCache`; a row whose prefix is
there copies it instead of reading it, so a row computes the same numbers whether or not it hit
the cache.

Questions that arrive together about one document would each read the prefix beside the others
(the same tokens, several times over, in the same steps). Instead one row reads it and the rows
with the same prefix wait for it (:meth:`SharedPrefixes.waits`), then copy its KV; if the reading
row goes (cancelled) before it is done, the next one reads it. A prefix too large for the cache
is read by every row that needs it (waiting would win nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from d3d.backends.kv import RowKV
from d3d.backends.target import BatchTarget
from d3d.engine.kv_store import PrefixCache
from d3d.engine.request import Row


class SharedPrefixes:
    """The scheduler's shared-prompt-prefix bookkeeping (see the module docstring)."""

    def __init__(self, cache: PrefixCache | None, target: BatchTarget, max_chunk: int):
        self.cache = cache
        self.target = target
        self.kv: RowKV = target.kv
        self.max_chunk = max_chunk

    def length(self, row: Row) -> int:
        """The row's shared prefix in tokens (0: none, or no cache to keep it)."""
        n = row.req.shared_prefix
        return n if self.cache is not None and 0 < n < len(row.req.prompt_ids) else 0

    def key(self, row: Row) -> str:
        if not row.prefix_key and self.cache is not None:
            row.prefix_key = self.cache.key(row.req.prompt_ids[: self.length(row)])
        return row.prefix_key

    def reuse(self, row: Row) -> None:
        """Copy the row's shared prefix from the cache into its KV, if it is there."""
        if self.length(row) and self.cache is not None:
            cached = self.cache.lookup_key(self.key(row))
            if cached is not None:
                self.kv.load(row.kv, cached)
                row.prefilled = row.stats.cached_prompt_tokens = self.length(row)

    def reading(self, rows: Iterable[Row]) -> set[str]:
        """The prefixes some row has started reading and not finished."""
        return {self.key(r) for r in rows if 0 < r.prefilled < self.length(r)}

    def waits(self, row: Row, reading: set[str]) -> bool:
        """Whether a row that has not started its prompt waits this step for another row that
        reads the same prefix. A row that does not wait either took the prefix from the cache
        (its reader is done) or reads it itself (added to ``reading``, so later rows wait)."""
        n, cache = self.length(row), self.cache
        if row.prefilled or not n or cache is None or not cache.keeps(n * self.kv.bytes_per_token):
            return False
        key = self.key(row)
        if key in reading:
            return True
        if key in cache:
            self.reuse(row)
        if not row.prefilled:
            reading.add(key)
        return False

    def keep(self, row: Row) -> None:
        """After a chunk: keep the row's KV if it has just read its whole shared prefix."""
        if self.cache is not None and row.prefilled == self.length(row):
            self.cache.store(row.req.prompt_ids[: row.prefilled], self.kv.snapshot(row.kv))

    def encode(self, ids: Sequence[int]) -> None:
        """Read a prefix into the cache (unless it is there) outside any request, in chunks as
        a request reads it, so rows that take it compute the same."""
        cache = self.cache
        if cache is None or not ids or cache.key(ids) in cache:
            return
        need = len(ids)
        self.kv.check(need)
        if not self.kv.fits(need):
            return  # the batch holds the KV now; the first request reads it itself
        row = self.kv.open(need)
        try:
            for i in range(0, need, self.max_chunk):
                run = list(ids[i : i + self.max_chunk])
                self.target.forward([row], [run], [[]])
                self.kv.commit(row, len(run))
            cache.store(list(ids), self.kv.snapshot(row))
        finally:
            self.kv.close(row)
