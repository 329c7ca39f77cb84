"""Slabs: the target's KV storage, rows of one capacity side by side so attention reads them at once.

A slab holds every row whose capacity is C, per layer in key and value tensors ``[S, Hkv, C, D]``
(S slots), its live rows packed in slots ``0 .. n-1``: a row that leaves is replaced by the last
one (its committed keys copied over, the only copy a row ever costs besides growing). Because
the rows of a slab are one tensor, the attention of its rows that add as many tokens (decoding:
one each; verifying: a block each) is one call per layer (:class:`~d3d.backends.ragged.Group`),
never one per row (a call costs ~15-25 us of CPU, a kernel
launch on a GPU: at 64 rows and 30 layers, ~2,000 of them a step).

A row grows by moving to the slab of the next capacity (doubling, in multiples of ``GROW``,
capped at the row's own reservation: a long request costs its own length, never the longest
row's times the batch). Slabs gain slots by doubling (or, for a burst of new rows, by as many as
are about to land, in one copy) and keep their free slots for the next
rows of their capacity (a busy server's rows come and go all the time; allocating and first
touching a slab costs more than the step it serves); the store's whole allocation never exceeds
``bound`` (:meth:`SlabStore.room`): before a slab would pass it, every slab gives its free slots
back, and :meth:`SlabStore.trim` gives them all back when the engine is idle with more than
half its budget allocated (a smaller working set stays, warm, for the next burst). New slots are
zeros and a slot only ever holds keys a model wrote after, so the masked tail of a slot that
attention reads is finite. The slabs are inference tensors: every method that writes them runs
in inference mode.

A store may keep its keys transposed, ``[S, Hkv, D, C]`` (``keys_t``): the layout vLLM's CPU
attention kernel reads a block's keys in, a slot being one block
(:mod:`d3d.backends.cpu.attention`). :meth:`Slab.keys` gives the same ``[count, Hkv, n, D]`` either
way (a view), so every other reader is unchanged.

Letters: S slots, C capacity (positions per slot), Hkv KV heads, D head dim, L layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROW = 64  # capacities are multiples of this many positions
FIRST = 4 * GROW  # a new row's capacity, unless its reservation is at most SHORT (then all of it)
SHORT = 2 * FIRST  # a reservation this small is taken whole by a new row


def round_up(n: int, to: int = GROW) -> int:
    return -(-n // to) * to


def next_capacity(current: int, length: int, reserved: int) -> int:
    """The capacity a row of ``current`` positions moves to when it needs ``length``: a power
    of two times GROW, at least double (a new row: at least ``FIRST``), never past its
    reservation rounded to GROW. A new row whose reservation is at most ``SHORT`` takes all of
    it: a chat request (a short prompt, a few hundred tokens to write) never moves (a move
    copies its keys, and a burst of them would build a slab of each size); a long one grows."""
    limit = round_up(max(reserved, length))
    if current == 0 and limit <= SHORT:
        return limit
    want = max(length, 2 * current, FIRST)
    grown = GROW * (1 << (round_up(want) // GROW - 1).bit_length())
    return min(grown, limit)


@dataclass(eq=False)  # rows are told apart by identity, never by their fields
class KvRow:
    """Where one row's keys live: its slab and slot, and its committed length."""

    reserved: int
    length: int = 0
    slab: Slab | None = None
    slot: int = 0

    @property
    def capacity(self) -> int:
        return self.slab.capacity if self.slab is not None else 0

    def keys(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n keys and values of ``layer``, in place: [1, Hkv, n, D] each."""
        return self.slab.keys(layer, self.slot, 1, n)


class Slab:
    """The rows of one capacity (see the module docstring)."""

    def __init__(
        self, capacity: int, shape: tuple[int, int, int], dtype, device, keys_t: bool = False
    ):
        self.capacity = capacity
        self.layers, self.kv_heads, self.head_dim = shape
        self.dtype, self.device = dtype, device
        self.keys_t = keys_t  # keys stored [S, Hkv, D, C] (module docstring)
        self.rows: list[KvRow] = []  # rows[i].slot == i
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def slots(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def keys(self, layer: int, first: int, count: int, n: int):
        """Keys and values of slots ``first .. first+count-1``, positions ``0 .. n-1``:
        [count, Hkv, n, D] each, in place."""
        k = self.k[layer].narrow(0, first, count)
        k = k.narrow(3, 0, n).transpose(2, 3) if self.keys_t else k.narrow(2, 0, n)
        return k, self.v[layer].narrow(0, first, count).narrow(2, 0, n)

    @torch.inference_mode()
    def resize(self, slots: int) -> None:
        """Hold ``slots`` slots (at least the live rows), keeping the live rows' keys."""
        n = len(self.rows)
        assert slots >= n, "a slab cannot drop live rows"
        if slots == self.slots:
            return
        shape = (slots, self.kv_heads, self.capacity, self.head_dim)
        shape_k = (slots, self.kv_heads, self.head_dim, self.capacity) if self.keys_t else shape
        make = lambda s: torch.empty(s, dtype=self.dtype, device=self.device)  # noqa: E731
        k = [make(shape_k) for _ in range(self.layers)]
        v = [make(shape) for _ in range(self.layers)]
        live = n if self.k else 0  # the live rows are copied, every other slot zeroed
        if live:
            torch._foreach_copy_(
                [t.narrow(0, 0, n) for t in k + v], [t.narrow(0, 0, n) for t in self.k + self.v]
            )
        if slots > live:
            torch._foreach_zero_([t.narrow(0, live, slots - live) for t in k + v])
        self.k, self.v = k, v

    def add(self, row: KvRow) -> None:
        """Put ``row`` in the next free slot (call :meth:`resize` first if there is none)."""
        assert len(self.rows) < self.slots, "no free slot"
        row.slab, row.slot = self, len(self.rows)
        self.rows.append(row)

    def vacate(self, slot: int) -> None:
        """Free ``slot``: the last row moves into it (its committed keys copied)."""
        last = self.rows.pop()
        if slot < len(self.rows):
            copy_keys(self, last.slot, self, slot, last.length)
            last.slot = slot
            self.rows[slot] = last


@torch.inference_mode()
def copy_keys(src: Slab, src_slot: int, dst: Slab, dst_slot: int, n: int) -> None:
    """Copy the first n positions of a slot's keys and values, every layer, in one call."""
    if n:
        torch._foreach_copy_(
            [k for layer in range(dst.layers) for k in dst.keys(layer, dst_slot, 1, n)],
            [k for layer in range(src.layers) for k in src.keys(layer, src_slot, 1, n)],
        )


class SlabStore:
    """Every slab of one model's KV, by capacity, under one allocation bound."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        bound: Callable[[], int],
        keys_t: bool = False,
    ):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.keys_t = keys_t
        self.bound = bound  # tokens the store may allocate now
        self.slabs: dict[int, Slab] = {}

    @property
    def allocated_tokens(self) -> int:
        return sum(s.slots * c for c, s in self.slabs.items())

    @torch.inference_mode()
    def place(self, row: KvRow, capacity: int, coming: int = 0) -> None:
        """Move ``row`` (with its committed keys) into the slab of ``capacity``; ``coming``:
        how many more rows are about to (a slab that must grow grows for them too, once,
        rather than doubling through a burst of new rows, a copy of its rows each time)."""
        slab = self.slabs.get(capacity)
        if slab is None:
            slab = self.slabs[capacity] = Slab(
                capacity, self.shape, self.dtype, self.device, self.keys_t
            )
        if len(slab.rows) == slab.slots:
            slab.resize(slab.slots + self.room(capacity, max(slab.slots, 1 + coming)))
        old, old_slot = row.slab, row.slot
        slab.add(row)
        if old is not None:
            copy_keys(old, old_slot, slab, row.slot, row.length)
            old.vacate(old_slot)

    def full(self, capacity: int) -> bool:
        """Whether a row placed in the slab of ``capacity`` now would make it grow."""
        slab = self.slabs.get(capacity)
        return slab is None or len(slab.rows) == slab.slots

    def room(self, capacity: int, want: int) -> int:
        """How many slots of ``capacity`` to add (at most ``want``, at least one): within the
        bound, after the other slabs give their free slots back if they must."""
        free = self.bound() - self.allocated_tokens
        if free < want * capacity:
            self.trim(keep=capacity)
            free = self.bound() - self.allocated_tokens
        return max(1, min(want, free // capacity))

    def release(self, row: KvRow) -> None:
        """Give ``row``'s slot back (to its slab, for the next row of its capacity)."""
        slab = row.slab
        if slab is not None:
            slab.vacate(row.slot)
            row.slab, row.slot = None, 0

    def trim(self, keep: int | None = None) -> None:
        """Give every free slot back; drop the slabs with no rows (but the one of ``keep``)."""
        for c in list(self.slabs):
            slab = self.slabs[c]
            if slab.rows or c == keep:
                slab.resize(len(slab.rows))
            else:
                del self.slabs[c]
