"""The CPU backend's attention for the engine's groups of rows (the hook of
:class:`~d3d.backends.ragged.Ragged`), three paths by what the group is:

- a group of a target whose attention modules vLLM's paged kernel took, over a slab that keeps
  its keys transposed for it: one kernel call (:mod:`d3d.backends.cpu.attention`);
- a prompt's chunk (a group at least ``SPLIT_WIDTH`` tokens wide), row by row, split at the
  row's cached length: the cached keys unmasked, the chunk's own keys causal (the flash kernel
  skips the blocks above the diagonal instead of reading a mask over them), the two merged by
  their log-sum-exps; the same attention up to summation order, computed the same way whatever
  else is in the step (docs/results.md has its measured gain);
- a float32 decode or verify group as two batched matmuls in which the query heads that share a
  key head are one matrix against it, so each key is read once.

Anything else (another dtype in a decode group) is left to PyTorch's attention in
:func:`~d3d.backends.ragged.ragged_attention`.

Letters: S slots, Hq / Hkv query / KV heads, G = Hq / Hkv, T new tokens a row, n keys read,
D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from d3d.backends.cpu.attention import MODULE_FLAG, attend
from d3d.backends.ragged import Group

SPLIT_WIDTH = 32  # groups this wide (prompt chunks) are attended split (module docstring)


def attend_group(
    module: nn.Module,
    query: torch.Tensor,
    out: torch.Tensor,
    g: Group,
    layer: int,
    scaling: float | None,
) -> bool:
    """Write group ``g``'s attention into ``out`` (query and out [1, Hq, N, D]) where a CPU path
    fits; False where none does."""
    if query.device.type != "cpu":
        return False
    paged = getattr(module, MODULE_FLAG, None)
    if paged is not None and g.slab.keys_t:
        rows = query[0].transpose(0, 1).contiguous()  # [N, Hq, D], free: query's layout
        out[0].transpose(0, 1).index_copy_(0, g.outputs, attend(rows, g, layer, scaling, paged))
        return True
    if g.width >= SPLIT_WIDTH:
        for slot, q0, length in g.rows:
            k, v = g.slab.keys(layer, slot, 1, length + g.width)
            o = _chunk_attention(query.narrow(2, q0, g.width), k, v, length, scaling)
            out[0].narrow(1, q0, g.width).copy_(o[0])
        return True
    if query.dtype != torch.float32:
        return False
    hq, d = query.shape[1], query.shape[3]
    q = query[0].index_select(1, g.queries).view(hq, g.count, g.width, d).transpose(0, 1)
    k, v = g.slab.keys(layer, g.first, g.count, g.n)
    o = _group_attention(q, k, v, g.mask, scaling)
    if g.members is not None:  # o: [count, Hq, T, D]
        o = o.index_select(0, g.members)
    out[0].index_copy_(1, g.outputs, o.transpose(0, 1).reshape(hq, -1, d))
    return True


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
