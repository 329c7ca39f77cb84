"""The target's KV cache: keys and values per row, each growing with its row, under a budget.

Every row (a running request) owns a slot of capacity C in the slab of that capacity
(:mod:`d3d.backends.slabs`): C grows with the row (doubling, in multiples of ``GROW`` positions,
never past what the row reserved), so a long request among short ones costs its own length,
never the longest row's times the batch; a row's keys are one view, read in place by attention
(no gather, no copy per step), and the rows of a slab that add as many tokens are read in one call.
The budget is ``max_tokens`` (``--max-kv-tokens``): a request reserves prompt + budget + one
block when it is admitted (:meth:`RowKV.fits`), so a running row never runs out, a request that
does not fit now waits, and one that could never fit is refused at once (:class:`KvLimitError`,
whose message names the limit). What is allocated at any moment is the slabs' slots, never more
than the budget (or the open rows' reservations rounded up to ``GROW``, if that is more).

A forward covers any list of rows, each with its own number T_r of new tokens, flattened into
one sequence of N tokens (:mod:`d3d.backends.ragged`). :meth:`RowKV.begin` gives the position ids
and the rows' :class:`~d3d.backends.ragged.Ragged` (a group per slab and number of new tokens: one
attention call and one key write per group and layer); :meth:`RowKV.update` (the Hugging Face ``Cache``
hook, called once per layer) writes each row's new keys at its own length, and the ragged
attention reads the row's slot up to its length plus T_r. Nothing is kept until
:meth:`commit`: rolling back rejected drafts is not committing them (their positions are
overwritten by the next write).

Letters: N new tokens of a forward, C a row's capacity, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from d3d.backends.ragged import Group, GroupAttention, Ragged, RaggedCache
from d3d.backends.sizes import free_bytes, head_dim, kv_bytes_per_token, kv_heads, kv_token_bytes
from d3d.backends.sizes import window as model_window
from d3d.backends.slabs import GROW, SHORT, KvRow, SlabStore, next_capacity, round_up

__all__ = ["GROW", "KvHooks", "KvLimitError", "KvRow", "RowKV", "default_kv_tokens"]

_NO_MASK = torch.empty(0, dtype=torch.bool)  # a kernel group's: the kernel masks by lengths


KernelWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class KvHooks:
    """What a backend adds to the slab KV (none: the reference's PyTorch paths).

    ``attend``: its attention for groups of rows (:data:`~d3d.backends.ragged.GroupAttention`).
    ``write``: a kernel that writes a group's new keys and values [N, Hkv, D] itself, called as
    ``write(keys, values, slab_k, slab_v, at)`` with ``at`` [N] = slot * C + position, into
    slabs that keep their keys transposed; such a kernel also attends a slab's rows as one group
    whatever each adds. ``pretouch(nbytes)``: fault in that much KV memory ahead of a burst
    (seconds taken, or None where it does nothing)."""

    attend: GroupAttention | None = None
    write: KernelWrite | None = None
    pretouch: Callable[[int], float | None] | None = None


class KvLimitError(ValueError):
    """A request needs more KV than the engine may ever hold (the message names the limit)."""

    def __init__(self, need: int, limit: int):
        super().__init__(
            f"the request needs {need} KV tokens (prompt + max_new_tokens + one draft block) but "
            f"the KV limit is {limit} tokens (--max-kv-tokens)"
        )
        self.need, self.limit = need, limit


def default_kv_tokens(model, share_cpu: float = 0.25, share_gpu: float = 0.8) -> int:
    """The KV budget when none is given: a share of the device's free memory (after the
    weights are loaded) over the bytes a token costs, at least one model window."""
    p = next(model.parameters())
    per = kv_bytes_per_token(model.config, p.dtype)
    budget = (share_gpu if p.device.type == "cuda" else share_cpu) * free_bytes(p.device)
    window = model_window(model.config) or 0
    return max(int(budget // per), window, GROW)


class RowKV(RaggedCache):
    """Per-row KV buffers for Llama/Qwen-style decoders (see the module docstring)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_tokens: int,
        keys_t: bool = False,
        hooks: KvHooks | None = None,
    ):
        super().__init__(num_layers)
        if max_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1, got {max_tokens}")
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_tokens = max_tokens
        self.reserved = 0
        self.rows: list[KvRow] = []  # open rows
        self.store = SlabStore(
            (num_layers, kv_heads, head_dim), dtype, self.device, self.bound_tokens, keys_t
        )
        self.hooks = hooks or KvHooks()
        self.kernel_write = self.hooks.write if keys_t else None  # writes keys it reads itself
        # one per group: (group, slots, positions), or kernel-written (group, slot * C + position)
        self._writes: list[tuple] = []

    @classmethod
    def for_model(
        cls, model, max_tokens: int, keys_t: bool = False, hooks: KvHooks | None = None
    ) -> RowKV:
        """A KV of ``model``'s shape, dtype and device (``keys_t``, ``hooks``: the backend's)."""
        cfg = model.config
        p = next(model.parameters())
        return cls(
            cfg.num_hidden_layers, kv_heads(cfg), head_dim(cfg), p.dtype, p.device, max_tokens,
            keys_t, hooks,
        )  # fmt: skip

    # -- the budget ----------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return kv_token_bytes(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def allocated_tokens(self) -> int:
        return self.store.allocated_tokens

    @property
    def allocated_bytes(self) -> int:
        return self.allocated_tokens * self.bytes_per_token

    def bound_tokens(self) -> int:
        """What the slabs may allocate: the budget, or the open rows' reservations rounded up
        to ``GROW`` if that is more (a row's capacity is a multiple of ``GROW``)."""
        return max(self.max_tokens, sum(round_up(max(r.reserved, r.length)) for r in self.rows))

    def pretouch(self, rows: int) -> float | None:
        """Fault in the memory of ``rows`` short requests' KV (``SHORT`` tokens each, within the
        budget) ahead of a burst, where the backend can (:class:`KvHooks`); the seconds it took,
        or None."""
        if self.hooks.pretouch is None:
            return None
        return self.hooks.pretouch(min(self.max_tokens, rows * SHORT) * self.bytes_per_token)

    def check(self, need: int) -> None:
        """Raise :class:`KvLimitError` if ``need`` tokens could never fit."""
        if need > self.max_tokens:
            raise KvLimitError(need, self.max_tokens)

    def fits(self, need: int) -> bool:
        """Whether a request reserving ``need`` tokens can be admitted now."""
        return self.reserved + need <= self.max_tokens

    def open(self, need: int) -> KvRow:
        """A new row reserving ``need`` tokens (call :meth:`fits` first)."""
        self.check(need)
        self.reserved += need
        row = KvRow(reserved=need)
        self.rows.append(row)
        return row

    def close(self, row: KvRow) -> None:
        """Give a row's slot and reservation back."""
        if row in self.rows:
            self.rows.remove(row)
            self.reserved -= row.reserved
        self.store.release(row)
        row.length, row.reserved = 0, 0

    def trim(self) -> None:
        """Give the slabs' free slots back (the engine calls this when it is idle)."""
        self.store.trim()

    # -- storage -------------------------------------------------------------------------------
    def ensure(self, row: KvRow, length: int) -> None:
        """Give ``row`` room for ``length`` positions (see :func:`~d3d.backends.slabs.next_capacity`)."""
        if length > row.capacity:
            capacity = next_capacity(row.capacity, length, row.reserved)
            coming = 0
            if row.slab is None and self.store.full(capacity):  # a burst of new rows: its size
                coming = sum(
                    r.slab is None and r is not row and next_capacity(0, 1, r.reserved) == capacity
                    for r in self.rows
                )
            self.store.place(row, capacity, coming)

    def load(self, row: KvRow, cache: DynamicCache) -> None:
        """Fill an empty row with a :class:`~transformers.DynamicCache`'s keys and values."""
        n = cache.get_seq_length()
        self.ensure(row, n)
        for i, layer in enumerate(cache.layers):
            k, v = row.keys(i, n)
            k.copy_(layer.keys)
            v.copy_(layer.values)
        row.length = n

    def snapshot(self, row: KvRow) -> DynamicCache:
        """A row's committed keys and values as a :class:`~transformers.DynamicCache` (copies)."""
        out = DynamicCache()
        for i in range(self.num_layers):
            if row.slab is not None:
                k, v = (t.clone() for t in row.keys(i, row.length))
            else:
                shape = (1, self.kv_heads, 0, self.head_dim)
                k = v = torch.empty(shape, dtype=self.dtype, device=self.device)
            out.update(k, v, i)
        return out

    # -- one forward ---------------------------------------------------------------------------
    def begin(self, rows: Sequence[KvRow], widths: Sequence[int]) -> tuple[torch.Tensor, Ragged]:
        """Prepare a ragged forward where row b appends ``widths[b]`` tokens (one after another
        in a flat sequence of N). Returns (position ids [1, N], the rows for
        :func:`~d3d.backends.ragged.ragged_attention`); the next ``update`` calls write row b's new
        keys at its positions ``len_b .. len_b + widths[b] - 1``."""
        for r, w in zip(rows, widths, strict=True):
            self.ensure(r, r.length + w)  # rows may change slots here: read slots after
        positions, alike = [], {}
        q = 0
        kernel = self.kernel_write is not None  # a slab's rows are one group, any widths
        for r, w in zip(rows, widths, strict=True):
            positions.append(torch.arange(r.length, r.length + w, device=self.device))
            key = (r.slab, 0 if kernel else w)
            alike.setdefault(key, []).append((r.slot, q, r.length, w))
            q += w
        self._writes, self.past = [], max(r.length for r in rows)
        whole = len(alike) == 1  # one group: its rows are the step, in order if slots are
        groups = [
            self._kernel_group(slab, items, whole)
            if kernel
            else self._group(slab, w, [i[:3] for i in items], whole)
            for (slab, w), items in alike.items()
        ]
        return torch.cat(positions)[None, :], Ragged(groups, self.hooks.attend)

    def _kernel_group(self, slab, items: list[tuple[int, int, int, int]], alone: bool) -> Group:
        """One kernel call for the rows of ``slab``: items are (slot, first query, length,
        width); the kernel takes each row's queries as a span and writes its keys."""
        items.sort()
        outputs = [q + t for _, q, _, w in items for t in range(w)]
        whole = alone and outputs == list(range(len(outputs)))
        out = torch.tensor(outputs, device=self.device)
        cap = slab.capacity
        at = [s * cap + n + t for s, _, n, w in items for t in range(w)]
        widths = tuple(w for *_, w in items)
        group = Group(
            slab,
            first=items[0][0],
            count=len(items),
            width=max(widths),
            n=0,  # the kernel reads each row's keys up to its own length
            queries=out,
            members=None,
            outputs=out,
            mask=_NO_MASK,
            rows=tuple(i[:3] for i in items),
            whole=whole,
            widths=widths,
        )
        self._writes.append((group, torch.tensor(at, device=self.device)))
        return group

    def _group(self, slab, width: int, items: list[tuple[int, int, int]], alone: bool) -> Group:
        """One attention call for the rows of ``slab`` that add ``width`` tokens each: items
        are (slot, first query, length); the call spans their slots and reads keys up to the
        longest row's end. ``alone``: the step has no other group."""
        items.sort()
        whole = alone and all(q == i * width for i, (_, q, _) in enumerate(items))
        dev = self.device
        it = torch.tensor(items, device=dev)  # [rows, 3]: slot, first query, length
        slot, q, length = it.unbind(1)
        first, count = items[0][0], items[-1][0] - items[0][0] + 1
        t = torch.arange(width, device=dev)
        members = None
        starts, lengths = q, length  # per slot of the span; a slot not in the step repeats
        # the first row's queries at length 0 (its output is dropped)
        if len(items) < count:
            members = slot - first
            starts = q[0].repeat(count).index_copy(0, members, q)
            lengths = length.new_zeros(count).index_copy(0, members, length)
        n = min(slab.capacity, round_up(max(i[2] for i in items) + width))
        sees = torch.arange(n, device=dev)[None, None, :] <= (lengths[:, None] + t)[:, :, None]
        group = Group(
            slab,
            first,
            count,
            width,
            n,
            (starts[:, None] + t).flatten(),
            members,
            (q[:, None] + t).flatten(),
            sees.view(count, 1, width, n),
            tuple(items),
            whole,
        )
        at = (length[:, None] + t).flatten()
        self._writes.append((group, slot.repeat_interleave(width), at))
        return group

    def commit(self, row: KvRow, n: int) -> None:
        """Keep the first n of the positions the last forward wrote for ``row``."""
        row.length += n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write each row's new keys [1, Hkv, T_r, D] (of [1, Hkv, N, D]) after its length.
        Returns the new keys as given: the ragged attention reads the rows' slots."""
        if self.kernel_write is not None:  # the backend's kernel, one call per group
            keys, values = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
            for g, at in self._writes:
                k = keys if g.whole else keys.index_select(0, g.outputs)  # [rows * T, Hkv, D]
                v = values if g.whole else values.index_select(0, g.outputs)
                self.kernel_write(k, v, g.slab.k[layer_idx], g.slab.v[layer_idx], at)
            return key_states, value_states
        for g, slots, at in self._writes:  # one write per group of rows
            k = key_states[0].index_select(1, g.outputs).transpose(0, 1)  # [rows * T, Hkv, D]
            v = value_states[0].index_select(1, g.outputs).transpose(0, 1)
            if g.slab.keys_t:
                g.slab.k[layer_idx][slots, :, :, at] = k
            else:
                g.slab.k[layer_idx][slots, :, at] = k
            g.slab.v[layer_idx][slots, :, at] = v
        return key_states, value_states
