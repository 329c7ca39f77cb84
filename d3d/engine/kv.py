"""The target's KV cache: one pool of token slots, pages per row, a budget you can state.

Every row (a running request) owns a list of pages of ``PAGE`` token slots in one pool per
layer (keys and values ``[P + 1, Hkv, D]``: P slots, then one scratch slot). A row's capacity
grows a page at a time with the row itself, so a long request among short ones costs its own
length, never the longest row's times the batch. The pool grows geometrically up to
``max_tokens`` (``--max-kv-tokens``), the budget admission works against: a request reserves
prompt + budget + one block when it is admitted (:meth:`PagedKV.fits`), so a running row never
runs out of pages, a request that does not fit now waits, and one that could never fit is
refused at once (:class:`KvLimitError`, whose message names the limit).

A forward covers any list of rows, each with its own number T_r of new tokens (padded to the
longest, T). :meth:`PagedKV.begin` computes where each new token's key goes (the row's slot for
its position; padding goes to the scratch slot) and which slots each row attends to
(``[n, L]``, L = the longest row's length + T), with the bool mask ``[n, 1, T, L]`` that lets
query t of row r see keys ``0 .. len_r + t``. :meth:`update` (the Hugging Face ``Cache`` hook,
called once per layer) writes the new keys and gathers each row's keys in position order, so a
row computes what it would alone. Nothing is kept until :meth:`commit`: rolling back rejected
drafts is not committing them (their slots are overwritten by the next write).

The gather copies a layer's keys for the rows in the forward (one layer at a time); that copy is
the price of pages without a custom attention kernel, and what a ``DynamicCache`` pays anyway
(it concatenates the whole cache at every step).

Letters: P pool slots, n rows, T new tokens per row, L attended keys, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import Cache, DynamicCache

PAGE = 16  # token slots per page
MIN_POOL = 64  # pages the pool starts with once a row needs one


class KvLimitError(ValueError):
    """A request needs more KV than the engine may ever hold (the message names the limit)."""

    def __init__(self, need: int, limit: int):
        super().__init__(
            f"the request needs {need} KV tokens (prompt + max_new_tokens + one draft block) but "
            f"the KV limit is {limit} tokens (--max-kv-tokens)"
        )
        self.need, self.limit = need, limit


@dataclass
class KvRow:
    """One row's pages, its committed length, and the tokens it reserved at admission."""

    reserved: int
    length: int = 0
    pages: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None  # [len(pages) * PAGE] pool slot of each position


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token costs in every layer of a model with ``config``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * size


def default_kv_tokens(model, share_cpu: float = 0.25, share_gpu: float = 0.8) -> int:
    """The KV budget when none is given: a share of the device's free memory (after the
    weights are loaded) over the bytes a token costs, at least one model window."""
    p = next(model.parameters())
    per = kv_bytes_per_token(model.config, p.dtype)
    if p.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(p.device)
        budget = share_gpu * free
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 8 << 30
        budget = share_cpu * free
    window = getattr(model.config, "max_position_embeddings", 0) or 0
    return max(int(budget // per) // PAGE * PAGE, window, PAGE)


class PagedKV(Cache):
    """A paged KV pool for Llama/Qwen-style decoders (see the module docstring)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_tokens: int,
    ):
        super().__init__(layers=[])
        if max_tokens < PAGE:
            raise ValueError(f"max_kv_tokens must be >= {PAGE}, got {max_tokens}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_pages = max_tokens // PAGE
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pages = 0  # pages allocated in the pool so far
        self.free: list[int] = []
        self.reserved = 0
        self._write: torch.Tensor | None = None
        self._gather: torch.Tensor | None = None
        self._kv_len = 0
        self._past = 0

    @classmethod
    def for_model(cls, model, max_tokens: int) -> PagedKV:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, p.dtype, p.device, max_tokens)

    # -- the budget ----------------------------------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return self.max_pages * PAGE

    @property
    def scratch(self) -> int:
        return self.pages * PAGE

    @property
    def bytes_per_token(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * size

    @property
    def allocated_bytes(self) -> int:
        return (self.scratch + 1) * self.bytes_per_token if self.k else 0

    def check(self, need: int) -> None:
        """Raise :class:`KvLimitError` if ``need`` tokens could never fit."""
        if _pages(need) > self.max_pages:
            raise KvLimitError(need, self.max_tokens)

    def fits(self, need: int) -> bool:
        """Whether a request reserving ``need`` tokens can be admitted now."""
        return self.reserved + _pages(need) <= self.max_pages

    def open(self, need: int) -> KvRow:
        """A new row reserving ``need`` tokens (call :meth:`fits` first)."""
        self.check(need)
        self.reserved += _pages(need)
        return KvRow(reserved=_pages(need))

    def close(self, row: KvRow) -> None:
        """Give a row's pages and reservation back."""
        self.free += row.pages
        self.reserved -= row.reserved
        row.pages, row.slots, row.length, row.reserved = [], None, 0, 0
        if self.reserved == 0:
            self.free.sort()

    # -- storage -------------------------------------------------------------------------------
    def _grow(self, pages: int) -> None:
        """Make the pool at least ``pages`` pages (geometrically, up to the limit)."""
        new = min(self.max_pages, max(pages, 2 * self.pages, MIN_POOL))
        shape = (new * PAGE + 1, self.kv_heads, self.head_dim)
        old = self.scratch
        k = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        v = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        for i in range(len(self.k)):
            k[i][:old] = self.k[i][:old]
            v[i][:old] = self.v[i][:old]
        self.k, self.v = k, v
        self.free += list(range(self.pages, new))
        self.pages = new

    def ensure(self, row: KvRow, length: int) -> None:
        """Give ``row`` pages for ``length`` positions."""
        need = _pages(length) - len(row.pages)
        if need <= 0:
            return
        if need > len(self.free):
            self._grow(self.pages + need - len(self.free))
        new, self.free = self.free[:need], self.free[need:]
        row.pages += new
        add = torch.tensor(new, dtype=torch.long, device=self.device)
        slots = (add[:, None] * PAGE + torch.arange(PAGE, device=self.device)).flatten()
        row.slots = slots if row.slots is None else torch.cat([row.slots, slots])

    def load(self, row: KvRow, cache: DynamicCache) -> None:
        """Fill an empty row with a :class:`~transformers.DynamicCache`'s keys and values."""
        n = cache.get_seq_length()
        self.ensure(row, n)
        assert row.slots is not None
        idx = row.slots[:n]
        for i, layer in enumerate(cache.layers):
            self.k[i][idx] = layer.keys[0].transpose(0, 1).to(self.dtype)
            self.v[i][idx] = layer.values[0].transpose(0, 1).to(self.dtype)
        row.length = n

    def snapshot(self, row: KvRow) -> DynamicCache:
        """A row's committed keys and values as a :class:`~transformers.DynamicCache` (copies)."""
        out = DynamicCache()
        idx = row.slots[: row.length] if row.slots is not None else None
        for i in range(self.num_layers):
            if idx is None:
                shape = (1, self.kv_heads, 0, self.head_dim)
                k = v = torch.empty(shape, dtype=self.dtype, device=self.device)
            else:
                k = self.k[i][idx].transpose(0, 1).unsqueeze(0)
                v = self.v[i][idx].transpose(0, 1).unsqueeze(0)
            out.update(k, v, i)
        return out

    # -- one forward ---------------------------------------------------------------------------
    def begin(
        self, rows: Sequence[KvRow], widths: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a forward where row b appends ``widths[b]`` tokens (padded to T).

        Returns (position ids [n, T], bool attention mask [n, 1, T, L]); the next ``update``
        calls write row b's new keys at its positions ``len_b .. len_b + widths[b] - 1``.
        """
        dev = self.device
        t_max = max(widths)
        lens = [r.length for r in rows]
        kv_len = max(lens) + t_max
        for r, w in zip(rows, widths, strict=True):
            self.ensure(r, r.length + w)
        scratch = self.scratch
        gather = torch.full((len(rows), kv_len), scratch, dtype=torch.long, device=dev)
        for b, (r, w) in enumerate(zip(rows, widths, strict=True)):
            assert r.slots is not None
            gather[b, : r.length + w] = r.slots[: r.length + w]
        base = torch.tensor(lens, device=dev)
        t = torch.arange(t_max, device=dev)
        pos = base[:, None] + t[None, :]  # [n, T]
        real = t[None, :] < torch.tensor(list(widths), device=dev)[:, None]  # [n, T]
        self._write = torch.where(real, gather.gather(1, pos.clamp_max(kv_len - 1)), scratch)
        self._gather, self._kv_len, self._past = gather, kv_len, max(lens)
        keys = torch.arange(kv_len, device=dev)
        mask = keys[None, None, None, :] <= pos[:, None, :, None]  # [n, 1, T, L]
        return pos, mask

    def commit(self, row: KvRow, n: int) -> None:
        """Keep the first n of the positions the last forward wrote for ``row``."""
        row.length += n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write [n, Hkv, T, D] at each row's slots; return keys/values [n, Hkv, L, D]."""
        assert self._write is not None and self._gather is not None, "begin() must come first"
        if not self.k:  # a forward before any row had pages cannot happen: begin() ensures them
            raise RuntimeError("the KV pool is empty")
        k, v = self.k[layer_idx], self.v[layer_idx]
        w = self._write.flatten()
        k[w] = key_states.transpose(1, 2).reshape(-1, self.kv_heads, self.head_dim).to(k.dtype)
        v[w] = value_states.transpose(1, 2).reshape(-1, self.kv_heads, self.head_dim).to(v.dtype)
        return k[self._gather].transpose(1, 2), v[self._gather].transpose(1, 2)

    # -- what the model may ask a Cache --------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._past

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self._kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_layers


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)
