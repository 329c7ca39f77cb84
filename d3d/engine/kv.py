"""The target's KV cache: keys and values per row, each growing with its row, under a budget.

Every row (a running request) owns, per layer, key and value buffers ``[1, Hkv, C, D]`` whose
capacity C grows with the row (doubling, in steps of ``GROW`` positions, never past what the row
reserved): a long request among short ones costs its own length, never the longest row's times
the batch, and a row's keys are one contiguous view, read in place by attention (no gather,
no copy per step). The budget is ``max_tokens`` (``--max-kv-tokens``): a request reserves
prompt + budget + one block when it is admitted (:meth:`RowKV.fits`), so a running row never
runs out, a request that does not fit now waits, and one that could never fit is refused at
once (:class:`KvLimitError`, whose message names the limit). What is allocated at any moment
is the rows' capacities, at most what they reserved.

A forward covers any list of rows, each with its own number T_r of new tokens, flattened into
one sequence of N tokens (:mod:`d3d.model.ragged`). :meth:`RowKV.begin` gives the position ids
and each row's :class:`~d3d.model.ragged.Segment`; :meth:`RowKV.update` (the Hugging Face
``Cache`` hook, called once per layer) writes each row's new keys at its own length, and the
ragged attention reads the row's buffer up to its length plus T_r. Nothing is kept until
:meth:`commit`: rolling back rejected drafts is not committing them (their positions are
overwritten by the next write).

Letters: N new tokens of a forward, C a row's capacity, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from d3d.model.memory import dtype_bytes, free_bytes, head_dim, kv_bytes_per_token, kv_heads
from d3d.model.ragged import RaggedCache, Segment

GROW = 64  # capacity is allocated in multiples of this many positions


class KvLimitError(ValueError):
    """A request needs more KV than the engine may ever hold (the message names the limit)."""

    def __init__(self, need: int, limit: int):
        super().__init__(
            f"the request needs {need} KV tokens (prompt + max_new_tokens + one draft block) but "
            f"the KV limit is {limit} tokens (--max-kv-tokens)"
        )
        self.need, self.limit = need, limit


@dataclass(eq=False)  # rows are told apart by identity, never by their tensors
class KvRow:
    """One row's key and value buffers per layer ``[1, Hkv, C, D]``, its committed length, and the
    tokens it reserved at admission."""

    reserved: int
    length: int = 0
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def keys(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n keys and values of ``layer``, in place: [1, Hkv, n, D] each."""
        return self.k[layer].narrow(2, 0, n), self.v[layer].narrow(2, 0, n)


def default_kv_tokens(model, share_cpu: float = 0.25, share_gpu: float = 0.8) -> int:
    """The KV budget when none is given: a share of the device's free memory (after the
    weights are loaded) over the bytes a token costs, at least one model window."""
    p = next(model.parameters())
    per = kv_bytes_per_token(model.config, p.dtype)
    budget = (share_gpu if p.device.type == "cuda" else share_cpu) * free_bytes(p.device)
    window = getattr(model.config, "max_position_embeddings", 0) or 0
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
    ):
        super().__init__(num_layers)
        if max_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1, got {max_tokens}")
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_tokens = max_tokens
        self.reserved = 0
        self.rows: list[KvRow] = []  # open rows (what is allocated)
        self._fwd: list[tuple[KvRow, int, int]] = []  # (row, first query, new tokens)

    @classmethod
    def for_model(cls, model, max_tokens: int) -> RowKV:
        cfg = model.config
        p = next(model.parameters())
        return cls(
            cfg.num_hidden_layers, kv_heads(cfg), head_dim(cfg), p.dtype, p.device, max_tokens
        )

    # -- the budget ----------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes(self.dtype)

    @property
    def allocated_bytes(self) -> int:
        return sum(r.capacity for r in self.rows) * self.bytes_per_token

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
        """Give a row's buffers and reservation back."""
        if row in self.rows:
            self.rows.remove(row)
            self.reserved -= row.reserved
        row.k, row.v, row.length, row.reserved = [], [], 0, 0

    # -- storage -------------------------------------------------------------------------------
    def ensure(self, row: KvRow, length: int) -> None:
        """Give ``row`` room for ``length`` positions (doubling, never past its reservation
        rounded up to ``GROW``)."""
        cap = row.capacity
        if length <= cap:
            return
        limit = -(-max(row.reserved, length) // GROW) * GROW
        new = min(max(length, 2 * cap), limit)
        new = -(-new // GROW) * GROW
        shape = (1, self.kv_heads, new, self.head_dim)
        k = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        v = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        n = row.length
        for i in range(len(row.k)):
            k[i][:, :, :n] = row.k[i][:, :, :n]
            v[i][:, :, :n] = row.v[i][:, :, :n]
        row.k, row.v = k, v

    def load(self, row: KvRow, cache: DynamicCache) -> None:
        """Fill an empty row with a :class:`~transformers.DynamicCache`'s keys and values."""
        n = cache.get_seq_length()
        self.ensure(row, n)
        for i, layer in enumerate(cache.layers):
            row.k[i][:, :, :n] = layer.keys.to(self.dtype)
            row.v[i][:, :, :n] = layer.values.to(self.dtype)
        row.length = n

    def snapshot(self, row: KvRow) -> DynamicCache:
        """A row's committed keys and values as a :class:`~transformers.DynamicCache` (copies)."""
        out = DynamicCache()
        for i in range(self.num_layers):
            if row.k:
                k, v = (t.clone() for t in row.keys(i, row.length))
            else:
                shape = (1, self.kv_heads, 0, self.head_dim)
                k = v = torch.empty(shape, dtype=self.dtype, device=self.device)
            out.update(k, v, i)
        return out

    # -- one forward ---------------------------------------------------------------------------
    def begin(
        self, rows: Sequence[KvRow], widths: Sequence[int]
    ) -> tuple[torch.Tensor, list[Segment]]:
        """Prepare a ragged forward where row b appends ``widths[b]`` tokens (one after another
        in a flat sequence of N). Returns (position ids [1, N], the rows' segments for
        :func:`~d3d.model.ragged.ragged_attention`); the next ``update`` calls write row b's new
        keys at its positions ``len_b .. len_b + widths[b] - 1``."""
        segments, positions, fwd = [], [], []
        q = 0
        for r, w in zip(rows, widths, strict=True):
            self.ensure(r, r.length + w)
            positions.append(torch.arange(r.length, r.length + w, device=self.device))
            segments.append(Segment(q, q + w, r.length, r))
            fwd.append((r, q, w))
            q += w
        self._fwd, self.past = fwd, max(r.length for r in rows)
        return torch.cat(positions)[None, :], segments

    def commit(self, row: KvRow, n: int) -> None:
        """Keep the first n of the positions the last forward wrote for ``row``."""
        row.length += n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write each row's new keys [1, Hkv, T_r, D] (of [1, Hkv, N, D]) after its length.
        Returns the new keys as given: the ragged attention reads the rows' buffers."""
        dst, src = [], []
        for row, q, w in self._fwd:  # one copy call for every row (a call costs ~5 us on a CPU)
            n = row.length
            dst += (row.k[layer_idx].narrow(2, n, w), row.v[layer_idx].narrow(2, n, w))
            src += (key_states.narrow(2, q, w), value_states.narrow(2, q, w))
        torch._foreach_copy_(dst, src)
        return key_states, value_states
