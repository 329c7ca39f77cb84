"""Ragged attention: many rows, each with its own new tokens and its own keys, in ONE forward.

The engine flattens a step's rows into one sequence ``[1, N]`` (a decoding row's anchor and
drafts, a prompt's next chunk, one after another; N = the sum of the rows' new tokens): every
linear map of the model then reads its weights once for the whole step, and a chunk of prompt
costs the running rows its own compute only, never a second pass over the weights, and no row
is padded to another's width. Only attention must stay within a row. The engine's rows
(:class:`~d3d.engine.kv.RowKV`) keep their keys in slabs (:mod:`d3d.engine.slabs`), and the
rows of a slab that add as many tokens (plain decoding: one each; verifying: a block each) are
attended as a :class:`Group`: one call per slab, width and layer over the rows' slots (query
``[rows, Hq, T, D]`` against keys ``[rows, Hkv, L, D]`` read in place), each row causal from its
own length; they reach the attention as a :class:`Ragged`. Rows with a mask of their own (the
drafter's blocks, which see all their slots) are attended one by one, as a list of
:class:`Segment` s. Either reaches the attention through the model's keyword arguments, which
Hugging Face passes down to the attention function.

On a CPU a prompt's chunk (a group at least ``SPLIT_WIDTH`` tokens wide) is attended row by row,
split at the row's cached length: the cached keys unmasked, the chunk's own keys causal (the
flash kernel skips the blocks above the diagonal instead of reading a mask over them), the two
merged by their log-sum-exps. The same attention up to summation order, computed the same way
whatever else is in the step (measured here, SmolLM2-135M, fp32, two threads: a 2,048-token
prompt's attention in one chunk 0.56x as long, in chunks of 512 0.9x; its whole reading ~0.94x).

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

from d3d.model.cpu_attention import MODULE_FLAG, attend

KWARG = "d3d_segments"
SPLIT_WIDTH = 32  # on a CPU, groups this wide (prompt chunks) are attended split (docstring)


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


@dataclass(frozen=True)
class Ragged:
    """One ragged forward's rows, in groups attended at once."""

    groups: Sequence[Group]


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
    cpu = query.device.type == "cpu"
    paged = getattr(module, MODULE_FLAG, None) if cpu else None  # vLLM's kernel (cpu_attention)
    if paged is not None:
        rows = query[0].transpose(0, 1).contiguous()  # [N, Hq, D], free: query's layout
    for g in batch.groups:
        if paged is not None and g.slab.keys_t:
            out[0].transpose(0, 1).index_copy_(0, g.outputs, attend(rows, g, layer, scaling, paged))
            continue
        if cpu and g.width >= SPLIT_WIDTH:
            for slot, q0, length in g.rows:
                k, v = g.slab.keys(layer, slot, 1, length + g.width)
                o = _chunk_attention(query.narrow(2, q0, g.width), k, v, length, scaling)
                out[0].narrow(1, q0, g.width).copy_(o[0])
            continue
        q = query[0].index_select(1, g.queries).view(hq, g.count, g.width, d).transpose(0, 1)
        k, v = g.slab.keys(layer, g.first, g.count, g.n)
        if cpu and q.dtype == torch.float32:
            o = _group_attention(q, k, v, g.mask, scaling)
        else:
            o = F.scaled_dot_product_attention(q, k, v, g.mask, scale=scaling, enable_gqa=gqa)
        if g.members is not None:  # o: [count, Hq, T, D]
            o = o.index_select(0, g.members)
        out[0].index_copy_(1, g.outputs, o.transpose(0, 1).reshape(hq, -1, d))
    return out.transpose(1, 2).contiguous()


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, log-sum-exp)


def _group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """A group's attention on a CPU as two batched matmuls: q [S, Hq, T, D], k / v [S, Hkv, n,
    D], ``sees`` bool [S, 1, T, n] -> [S, Hq, T, D]. The G = Hq / Hkv query heads that share a
    key head are one matrix against it, so each key is read once, not once per query head (the
    flash kernel's way): a decode step is bound by reading the keys; at 64 rows this attention
    took ~0.6x the kernel's time in isolation, ~0.8x inside a step (keys from memory). Scores in
    float32, a row's hidden keys at -inf (every query sees at least its row's first key, so no
    row of the softmax is empty)."""
    s, hq, t, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    scores = torch.matmul(q.reshape(s, hkv, g * t, d), k.transpose(2, 3))  # [S, Hkv, G*T, n]
    scores = scores.view(s, hkv, g, t, n).mul_(scale if scale is not None else d**-0.5)
    scores.masked_fill_(~sees.view(s, 1, 1, t, n), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(s, hkv, g * t, n)
    return torch.matmul(probs, v).view(s, hq, t, d)


def _chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float | None
) -> torch.Tensor:
    """One row's T new tokens after ``past`` cached ones: q [1, Hq, T, D], k / v [1, Hkv, n,
    D] (n >= past + T) -> [1, Hq, T, D]. The chunk's own keys causal, the cached keys
    unmasked, merged by the two parts' log-sum-exps."""
    t = q.shape[2]
    own = (k.narrow(2, past, t), v.narrow(2, past, t))
    o2, l2 = _FLASH(q, *own, 0.0, True, scale=scale)
    if past == 0:
        return o2
    o1, l1 = _FLASH(q, k.narrow(2, 0, past), v.narrow(2, 0, past), 0.0, False, scale=scale)
    w1 = torch.sigmoid(l1 - l2).unsqueeze(-1)  # e^l1 / (e^l1 + e^l2)
    return torch.lerp(o2, o1, w1.to(o1.dtype))


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
