"""The CUDA backend's KV: one slab of fixed slots, allocated once, that graphs can address.

A captured step reads and writes the same tensors at every replay, so the KV never moves: per
layer one key and one value tensor ``[S, Hkv, C, D]`` (S slots of C positions), allocated at
start. It is the slab KV of :class:`~d3d.backends.kv.RowKV` with a single slab that never grows,
shrinks or is given back; a row takes a slot when it first writes and keeps it (the last row
moves into a slot that is freed, so live rows always fill slots ``0 .. n-1``: a step over every
row is a step over the first n slots, :mod:`d3d.backends.cuda.forward`). Prompt chunks and
mixed steps go through the slab KV's ragged path unchanged.

The shape is chosen from the token budget and the rows the engine may run at once
(:func:`static_shape`): every row gets ``budget / rows`` positions while that is at least
:data:`MIN_CAPACITY`, otherwise fewer slots of that capacity; never past the model's window. A
request that needs more than a slot is refused at once, naming the limit.

Letters: S slots, C a slot's capacity, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import torch

from d3d.backends.kv import KvLimitError, RowKV
from d3d.backends.slabs import GROW, KvRow, Slab

MIN_CAPACITY = 1024  # a slot's fewest positions while the budget allows


def static_shape(max_tokens: int, rows: int, window: int | None) -> tuple[int, int]:
    """(slots, capacity) for a budget of ``max_tokens`` over at most ``rows`` rows at once
    (module docstring); capacity rounded up to a multiple of ``GROW``."""
    limit = window or max_tokens
    capacity = min(limit, max_tokens // max(rows, 1))
    slots = max(rows, 1)
    if capacity < MIN_CAPACITY and rows > 1:
        capacity = min(limit, MIN_CAPACITY, max_tokens)
        slots = max(1, min(rows, max_tokens // max(capacity, 1)))
    capacity = max(GROW, -(-capacity // GROW) * GROW)  # rounded up: a row may hold its all
    return slots, capacity


class SlotLimitError(KvLimitError):
    """A request needs more positions than a slot holds."""

    def __init__(self, need: int, capacity: int, slots: int):
        ValueError.__init__(
            self,
            f"the request needs {need} KV tokens (prompt + max_new_tokens + one draft block) but "
            f"a row holds at most {capacity} tokens on the cuda backend ({slots} rows of "
            f"{capacity}: raise --max-kv-tokens or lower --max-batch for longer rows)",
        )
        self.need, self.limit = need, capacity


class StaticKV(RowKV):
    """The slab KV with one fixed slab (see the module docstring)."""

    def __init__(self, num_layers, kv_heads, head_dim, dtype, device, slots: int, capacity: int):
        super().__init__(num_layers, kv_heads, head_dim, dtype, device, slots * capacity)
        self.slots, self.capacity = slots, capacity
        self.slab = Slab(capacity, (num_layers, kv_heads, head_dim), dtype, self.device)
        self.slab.resize(slots)  # zeros: a slot only ever holds keys a model wrote after
        self.store.slabs[capacity] = self.slab

    @classmethod
    def shaped(cls, model, max_tokens: int, rows: int) -> StaticKV:
        """A static KV for ``model`` (:func:`static_shape` of its budget and rows)."""
        from d3d.backends.sizes import head_dim, kv_heads
        from d3d.backends.sizes import window as model_window

        cfg = model.config
        p = next(model.parameters())
        window = model_window(cfg)
        slots, capacity = static_shape(max_tokens, rows, window)
        return cls(
            cfg.num_hidden_layers, kv_heads(cfg), head_dim(cfg), p.dtype, p.device, slots, capacity
        )

    @property
    def keys(self) -> list[torch.Tensor]:
        return self.slab.k

    @property
    def values(self) -> list[torch.Tensor]:
        return self.slab.v

    def check(self, need: int) -> None:
        if need > self.capacity:
            raise SlotLimitError(need, self.capacity, self.slots)
        super().check(need)

    def fits(self, need: int) -> bool:
        return len(self.rows) < self.slots and need <= self.capacity and super().fits(need)

    def ensure(self, row: KvRow, length: int) -> None:
        if length > self.capacity:  # admission keeps every row within its slot
            raise SlotLimitError(length, self.capacity, self.slots)
        if row.slab is None:
            self.slab.add(row)

    def trim(self) -> None:
        """Nothing: the slots stay where the graphs read them."""
