"""A KV cache whose rows grow and roll back independently.

``DynamicCache`` keeps one length for the whole batch, so a batch cannot hold requests of
different lengths, and rolling one row back (rejected draft tokens) would roll back every row.
:class:`RowCache` instead preallocates, per layer, keys and values of shape ``[R, Hkv, C, D]``
(R row slots, capacity C) and keeps one valid length per slot. A forward covers a contiguous run
of slots; each row's T new keys are written at that row's own offset, and attention sees keys
``[0, L)`` with L the longest row plus T, under a 4D mask (:meth:`RowCache.attention_mask`)
that hides each row's unused slots. Rolling a row back is lowering its length: stale keys past the
length are masked out and overwritten by the next write.

Slots and capacity grow on demand (copying once), and :meth:`move` relocates a row so that live
rows stay packed at the front (slot order is free: every row carries its own positions).

Letters: R row slots, C capacity, L attended keys, T new tokens, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache

GROW = 64  # capacity is allocated in multiples of this many positions


class RowCache(Cache):
    """Per-row KV cache for Llama/Qwen-style decoders (see the module docstring)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__(layers=[])
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.lengths: list[int] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._alloc(0, 0)
        self._rows = slice(0, 0)
        self._write: torch.Tensor | None = None
        self._kv_len = 0

    @classmethod
    def for_model(cls, model) -> RowCache:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, p.dtype, p.device)

    # -- storage -------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def _alloc(self, rows: int, capacity: int) -> None:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        new_k = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        new_v = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        if self.k:
            r, c = min(rows, self.rows), min(capacity, self.capacity)
            for i in range(self.num_layers):
                new_k[i][:r, :, :c] = self.k[i][:r, :, :c]
                new_v[i][:r, :, :c] = self.v[i][:r, :, :c]
        self.k, self.v = new_k, new_v
        self.lengths = (self.lengths + [0] * rows)[:rows]

    def reserve(self, rows: int, capacity: int) -> None:
        """Make room for ``rows`` slots of ``capacity`` positions (grows geometrically)."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        new_rows = max(rows, self.rows, min(2 * self.rows, rows + 8))
        new_cap = max(capacity, self.capacity)
        if new_cap > self.capacity:
            new_cap = max(new_cap, 2 * self.capacity)
        self._alloc(new_rows, -(-new_cap // GROW) * GROW)

    def release(self) -> None:
        """Free the storage (no live rows)."""
        self.k, self.v, self.lengths = [], [], []
        self._alloc(0, 0)

    def move(self, src: int, dst: int) -> None:
        """Copy row ``src`` into slot ``dst`` (``src`` becomes free)."""
        n = self.lengths[src]
        for i in range(self.num_layers):
            self.k[i][dst, :, :n] = self.k[i][src, :, :n]
            self.v[i][dst, :, :n] = self.v[i][src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def load(self, slot: int, cache) -> None:
        """Fill an empty slot with a :class:`~transformers.DynamicCache`'s keys and values."""
        n = cache.get_seq_length()
        self.reserve(slot + 1, n)
        for i, layer in enumerate(cache.layers):
            self.k[i][slot, :, :n] = layer.keys[0].to(self.dtype)
            self.v[i][slot, :, :n] = layer.values[0].to(self.dtype)
        self.lengths[slot] = n

    def snapshot(self, slot: int) -> DynamicCache:
        """A slot's committed keys and values as a :class:`~transformers.DynamicCache` (copies)."""
        n = self.lengths[slot]
        out = DynamicCache()
        for i in range(self.num_layers):
            out.update(
                self.k[i][slot : slot + 1, :, :n].clone(),
                self.v[i][slot : slot + 1, :, :n].clone(),
                i,
            )
        return out

    # -- one forward ---------------------------------------------------------------------------
    def begin(self, start: int, stop: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a forward over slots ``[start, stop)`` with T new tokens per row.

        Returns (position ids [n, T], bool attention mask [n, 1, T, L]); the next ``update`` calls
        write row b's keys at positions ``lengths[b] .. lengths[b] + T - 1``.
        """
        self.reserve(stop, 0)
        lens = self.lengths[start:stop]
        self.reserve(stop, max(lens) + new_tokens)
        t = torch.arange(new_tokens, device=self.device)
        base = torch.tensor(lens, device=self.device)
        pos = base[:, None] + t[None, :]  # [n, T]
        self._rows, self._write, self._kv_len = slice(start, stop), pos, max(lens) + new_tokens
        keys = torch.arange(self._kv_len, device=self.device)
        mask = keys[None, None, None, :] <= pos[:, None, :, None]  # [n, 1, T, L]
        return pos, mask

    def commit(self, slot: int, n: int) -> None:
        """Keep the first n of the positions the last forward wrote for ``slot``."""
        self.lengths[slot] += n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write [n, Hkv, T, D] at each row's offset; return keys/values [n, Hkv, L, D]."""
        assert self._write is not None, "RowCache.begin must precede a forward"
        k, v = self.k[layer_idx], self.v[layer_idx]
        rows = torch.arange(self._rows.start, self._rows.stop, device=self.device)[:, None]
        k[rows, :, self._write] = key_states.transpose(1, 2).to(k.dtype)
        v[rows, :, self._write] = value_states.transpose(1, 2).to(v.dtype)
        return k[self._rows, :, : self._kv_len], v[self._rows, :, : self._kv_len]

    # -- what the model may ask a Cache --------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths[self._rows], default=0)

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self._kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_layers
