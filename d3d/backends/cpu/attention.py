"""The engine's groups of rows attended by vLLM's CPU attention kernel, one call per group.

vLLM's CPU build ships a varlen attention over a paged KV cache (``cpu_attention_with_kv_cache``):
for each request its new queries against its keys, causal from its cached length, read through a
block table. The engine's slabs (:mod:`d3d.backends.slabs`) are such a cache already when a slot is
taken as one block (a slab's capacity is a multiple of 64, the kernel takes multiples of 32) and
the keys are stored as the kernel reads a block's keys, transposed (``[S, Hkv, D, C]``, found by
writing through vLLM's ``cpu_attn_reshape_and_cache``); values are stored as the slabs store them.
It takes less time than the engine's own CPU paths (torch's flash kernel, a call per row, for
prompt chunks; two matmuls for decode steps), with the same results to float rounding
(measured: docs/results.md, "Figures from the code's docstrings").

:func:`enable` marks a model's attention modules when the kernel, on a sample slab of the model's
head shape, gives what PyTorch's attention gives; :func:`paged_attention` tells the engine's KV to
keep its keys transposed for such a model. :func:`attend` is one group's attention, called by
:func:`~d3d.backends.ragged.ragged_attention` only for a marked module over a transposed slab (any
other model, or rows with a mask of their own, keep their paths). The kernel's per-step schedule
is built once per group and shared by every layer (``Group.memo``).

Letters: M rows of the group, T new tokens a row, N new tokens of the step, Hq / Hkv query / KV
heads, D head dim, S slots, C a slot's capacity.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from d3d.backends import check
from d3d.backends.cpu import vllm_kernels

log = logging.getLogger(__name__)

MODEL_FLAG = "_d3d_paged_attention"  # on the model: the kernel's ISA (its KV keeps keys transposed)
MODULE_FLAG = "_d3d_paged_isa"  # on each attention module: the kernel's ISA


def paged_attention(model: nn.Module) -> str | None:
    """The ISA of vLLM's kernel that runs ``model``'s attention (its KV must then store keys
    transposed, and :func:`write` writes them), or None."""
    return getattr(model, MODEL_FLAG, None)


def enable(model: nn.Module) -> int:
    """Mark ``model``'s attention modules for vLLM's kernel where a sample agrees; how many."""
    layers = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    cfg = getattr(model, "config", None)
    if not layers or cfg is None:
        return 0
    p = next(model.parameters())
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    isa = _isa(p.dtype, d)
    if p.device.type != "cpu" or isa is None or not _sample_agrees(hq, hkv, d, p.dtype, isa):
        return 0
    for m in layers:
        setattr(m, MODULE_FLAG, isa)
    setattr(model, MODEL_FLAG, isa)
    return len(layers)


def _isa(dtype: torch.dtype, d: int) -> str | None:
    """vLLM's kernel variant for this dtype and head dim (None: it has none)."""
    return vllm_kernels.attention_isa(dtype, d)


def _sample_agrees(hq: int, hkv: int, d: int, dtype: torch.dtype, isa: str) -> bool:
    """Three rows (5, 0 and 40 cached keys; three, one and two new tokens) in a store of the
    slabs' layout: the kernel's attention against PyTorch's, row by row."""
    torch.manual_seed(0)
    c, lengths, widths = 64, (5, 0, 40), (3, 1, 2)
    k = torch.randn(len(lengths), hkv, d, c, dtype=dtype)  # keys stored transposed
    v = torch.randn(len(lengths), hkv, c, d, dtype=dtype)
    q = torch.randn(sum(widths), hq, d, dtype=dtype)
    starts = [0, *itertools.accumulate(widths)]
    rows = [(slot, starts[slot], n) for slot, n in enumerate(lengths)]
    with torch.inference_mode():
        try:
            got = _run(q, k, v, rows, widths, d**-0.5, isa, {})
        except RuntimeError as e:
            log.warning("vLLM's CPU attention refused a sample: %s", e)
            return False
        want = []
        for (slot, q0, n), width in zip(rows, widths, strict=True):
            keys = k[slot : slot + 1, :, :, : n + width].transpose(2, 3)
            values = v[slot : slot + 1, :, : n + width]
            sees = torch.arange(n + width)[None, :] <= (n + torch.arange(width))[:, None]
            qi = q[q0 : q0 + width].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qi, keys, values, sees, scale=d**-0.5, enable_gqa=True
            )
            want.append(o[0].transpose(0, 1))
        want_t = torch.cat(want)
    return check.relative_error(got, want_t) <= check.TOLERANCE


def attend(
    query: torch.Tensor, group: Any, layer: int, scale: float | None, isa: str
) -> torch.Tensor:
    """One group's attention: query [N, Hq, D] (the step's, in place) -> [M * T, Hq, D] for the
    group's rows in slot order (their queries' positions: ``group.outputs``)."""
    d = query.shape[-1]
    q = query if group.whole else query.index_select(0, group.outputs)
    k, v = group.slab.k[layer], group.slab.v[layer]
    widths = group.widths or (group.width,) * len(group.rows)
    return _run(q, k, v, group.rows, widths, scale or d**-0.5, isa, group.memo)


def write(
    key: torch.Tensor,
    value: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    isa: str,
) -> None:
    """Write new keys and values [N, Hkv, D] (rows may be strided) into a store k [S, Hkv, D, C]
    (transposed) / v [S, Hkv, C, D] at ``slots`` [N] (slot * C + position), as the kernel will
    read them: one call for keys and values, where indexing them in takes two scatters."""
    ops = vllm_kernels.ops()
    kc = k.view(k.shape[0], k.shape[1], k.shape[3], k.shape[2])  # the kernel's view of a block
    ops.cpu_attn_reshape_and_cache(key, value, kc, v, slots, isa)


def _run(q, k, v, rows, widths, scale: float, isa: str, memo: dict) -> torch.Tensor:
    """vLLM's kernel over ``rows`` ((slot, first query, length) each) of a store k [S, Hkv, D,
    C] (transposed), v [S, Hkv, C, D]; ``widths``: each row's new tokens, queries q [sum
    widths, Hq, D] in the rows' order."""
    ops = vllm_kernels.ops()
    if "schedule" not in memo:  # the same for every layer of the step
        m = len(rows)
        seq = [n + w for (_, _, n), w in zip(rows, widths, strict=True)]
        seq = torch.tensor(seq, dtype=torch.int32)
        starts = torch.tensor([0, *itertools.accumulate(widths)], dtype=torch.int32)
        table = torch.tensor([[slot] for slot, _, _ in rows], dtype=torch.int32)
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=m,
            num_heads=q.shape[1],
            num_kv_heads=k.shape[1],
            head_dim=q.shape[2],
            seq_lens=seq,
            dtype=q.dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=True,
        )
        memo["schedule"] = (seq, starts, table, schedule)
    seq, starts, table, schedule = memo["schedule"]
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q,
        key_cache=k.view(k.shape[0], k.shape[1], k.shape[3], k.shape[2]),  # a block: [D, C]
        value_cache=v,
        output=out,
        query_start_loc=starts,
        seq_lens=seq,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=table,
        softcap=0.0,
        scheduler_metadata=schedule,
        s_aux=None,
    )
    return out
