"""Ragged attention: many rows, each with its own new tokens and its own keys, in ONE forward.

The engine flattens a step's rows into one sequence ``[1, N]`` (a decoding row's anchor and
drafts, a prompt's next chunk, one after another; N = the sum of the rows' new tokens): every
linear map of the model then reads its weights once for the whole step, and a chunk of prompt
costs the running rows its own compute only, never a second pass over the weights, and no row
is padded to another's width. Only attention must stay within a row. The engine's rows
(:class:`~d3d.backends.kv.RowKV`) keep their keys in slabs (:mod:`d3d.backends.slabs`), and the
rows of a slab that add as many tokens (plain decoding: one each; verifying: a block each) are
attended as a :class:`Group`: one call per slab, width and layer over the rows' slots (query
``[rows, Hq, T, D]`` against keys ``[rows, Hkv, L, D]`` read in place), each row causal from its
own length; they reach the attention as a :class:`Ragged`. Rows with a mask of their own (the
drafter's blocks, which see all their slots) are attended one by one, as a list of
:class:`Segment` s. Either reaches the attention through the model's keyword arguments, which
Hugging Face passes down to the attention function.

How a group is attended is the backend's: a :class:`Ragged` may carry an ``attend`` hook (the
CPU backend's: vLLM's paged kernel, a prompt's chunk split at its cached length, a decode
group's two matmuls, :mod:`d3d.backends.cpu.attention`) that takes the groups it has a faster
path for and leaves the rest to PyTorch's ``scaled_dot_product_attention`` here.

It is installed as a wrapper around the ``sdpa`` attention entry (the engine runs its target
with sdpa): a forward without ``d3d_segments`` (any other caller of the same model, in any
thread) runs exactly the original function.

Letters: N new tokens of the step, Hq / Hkv query / KV heads, D head dim, T_r / L_r one row's
new tokens / keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

KWARG = "d3d_segments"


@dataclass(frozen=True)
class Segment:
    """One row of a ragged forward: its queries ``[q0, q1)`` of the N new tokens, its cached
    length ``past``, the row whose buffers hold its keys (anything with
    ``keys(layer, n) -> (k, v)``, [1, Hkv, n, D] each), and its mask when it is not causal (a
    drafter's block sees all of its own slots)."""

    q0: int
    q1: int
    past: int
    row: Any
    mask: torch.Tensor | None = None  # bool [T, past + T]; None: causal from ``past``


@dataclass(frozen=True)
class Group:
    """Rows that each add the same number T of tokens (a plain decoding step: 1; a draft block:
    K + 1) and keep their keys in consecutive slots ``first .. first+count-1`` of one store
    (``slab.keys(layer, first, count, n)`` -> [count, Hkv, n, D] each, in place): their
    attention is one call per layer, not one per row. ``queries`` [count * T]: slot first+i's
    queries among the N new tokens (a slot whose row is not in the step repeats another's and
    its output is dropped); ``members``: the slots that are rows of the step (None: all),
    ``outputs`` [members * T] their queries' positions; ``mask`` [count, 1, T, n]: a row's
    query t sees its keys up to its own length + t; ``rows``: (slot, first query, length) of
    each row of the step, in slot order. Where vLLM's kernel attends (it takes each row's
    queries as a span of its own), the rows of a slab are one group whatever they add
    (``widths``: their new tokens, T the widest; ``queries`` = ``outputs``, no ``mask``): a
    step in which one row verifies a draft among plain rows is still one call per layer."""

    slab: Any
    first: int
    count: int
    width: int
    n: int
    queries: torch.Tensor
    members: torch.Tensor | None
    outputs: torch.Tensor
    mask: torch.Tensor
    rows: tuple[tuple[int, int, int], ...]
    whole: bool = False  # the group's rows are the whole step, in query order (no gather)
    widths: tuple[int, ...] = ()  # each row's new tokens where they differ (vLLM's kernel only)
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-step, all layers


GroupAttention = Callable[..., bool]
"""A backend's attention for the groups it has a faster path for: called as ``attend(module,
query, out, group, layer, scaling)`` with query [1, Hq, N, D] and ``out`` of the same layout,
it writes the group's rows into ``out`` and returns True, or returns False to leave the group to
PyTorch's attention."""


@dataclass(frozen=True)
class Ragged:
    """One ragged forward's rows, in groups attended at once; ``attend``: the backend's hook."""

    groups: Sequence[Group]
    attend: GroupAttention | None = None


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: Ragged | Sequence[Segment],
    scaling: float | None = None,
) -> torch.Tensor:
    """query [1, Hq, N, D] (key, value: the step's new keys, already in the rows' buffers)
    -> attention output [1, N, Hq, D]. ``batch``: the engine's rows in groups, or rows one by
    one as segments."""
    layer = module.layer_idx
    gqa = query.shape[1] != key.shape[1]

    def one(s: Segment) -> torch.Tensor:  # [1, Hq, T, D]
        t = s.q1 - s.q0
        q = query.narrow(2, s.q0, t)
        k, v = s.row.keys(layer, s.past + t)
        mask = s.mask
        if mask is None and t > 1:  # query i sees keys 0 .. past + i
            keys = torch.arange(s.past + t, device=q.device)
            mask = keys[None, :] <= (s.past + torch.arange(t, device=q.device))[:, None]
        return F.scaled_dot_product_attention(q, k, v, mask, scale=scaling, enable_gqa=gqa)

    if not isinstance(batch, Ragged):
        return torch.cat([one(s) for s in batch], dim=2).transpose(1, 2).contiguous()
    out = torch.empty_like(query)  # the layout of [1, N, Hq, D]: the transpose below is free
    hq, d = query.shape[1], query.shape[3]
    for g in batch.groups:
        if batch.attend is not None and batch.attend(module, query, out, g, layer, scaling):
            continue
        q = query[0].index_select(1, g.queries).view(hq, g.count, g.width, d).transpose(0, 1)
        k, v = g.slab.keys(layer, g.first, g.count, g.n)
        o = F.scaled_dot_product_attention(q, k, v, g.mask, scale=scaling, enable_gqa=gqa)
        if g.members is not None:  # o: [count, Hq, T, D]
            o = o.index_select(0, g.members)
        out[0].index_copy_(1, g.outputs, o.transpose(0, 1).reshape(hq, -1, d))
    return out.transpose(1, 2).contiguous()


class RaggedCache(Cache):
    """What a ragged forward's ``Cache`` tells the model: ``past``, the longest row's cached
    length, and no mask of its own (the segments carry the rows' masks). Subclasses write each
    segment's new keys where its row keeps them (:meth:`update`)."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.past = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return 1, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_layers


def _wrap(original: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        segments = kwargs.get(KWARG)
        if segments is None:
            return original(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        return ragged_attention(module, query, key, value, segments, scaling), None

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    return attention


def install() -> None:
    """Wrap the ``sdpa`` attention entry (once; idempotent)."""
    current = AttentionInterface._global_mapping.get("sdpa", sdpa_attention_forward)
    if not hasattr(current, "__wrapped__"):
        AttentionInterface.register("sdpa", _wrap(current))


install()
