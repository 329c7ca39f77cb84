"""Triton kernels for the cuda backend's decode step: the elementwise chains between its matrix
products, one kernel each, so a captured step launches about half the kernels a layer.

Inside a CUDA graph a kernel still costs a launch slot and a minimum run of a few microseconds;
after :mod:`d3d.backends.cuda.fused` a Qwen3 layer is four products, an attention call and about
nineteen small kernels, and at one row those small kernels are a fifth of the step. Four
kernels take their place:

- :func:`add_norm`: the residual add and the next RMSNorm (``h += delta``; ``x = norm(h)``),
  twice a layer: four kernels become two.
- :func:`qk_in`: what lies between the q/k/v product and attention — the per-head RMSNorm of q
  and k (Qwen3), the rotation of both, the new keys and values written into their slots, and q
  laid out as attention reads it ([B, Hkv, G*T, D]): about eleven kernels become one.
- :func:`silu_mul`: the MLP's ``silu(gate) * up``: two kernels become one.
- :func:`attend`: attention of a step whose queries each see their row's keys before a limit
  (the target's plain and verify steps, a drafter's chain) and, where given, a band (a
  drafter's block: its visible prefix by the limit, its own slots by the band), split over the
  keys: torch's attention with a mask runs one program per (row, key head), 8 of an H100's 132
  SMs at one row of Qwen3-8B, each reading its head's whole context; here each program reads a
  chunk of its row's keys for a tile of at most 64 queries (the keys in even chunks of whole
  64-key tiles, chunks enough for two programs an SM), keeps its running maximum and sum, and
  a second kernel joins the chunks. No mask is built or read, and nothing depends on how many
  keys a row has: one captured step serves every context. Float32 products stay float32 (not
  TF32).

Each rounds where the model's own code rounds (the sum before the norm, the normalised value
before its weight, each product of the rotation before their sum), so it agrees with the torch
forms it replaces to the last bit or so; the step takes a kernel only where a sample on the
model's device and dtype agrees (``StaticForward``). This module imports Triton: it is imported
by :func:`d3d.backends.cuda.taken.kernels_for` only where a GPU runs it, or where
``TRITON_INTERPRET=1`` runs it on the CPU (the tests; Triton 3.6's interpreter cannot take a
runtime loop bound with numpy 2.5, its own limit, not the kernels').

Letters: N new tokens (B rows of T), H hidden, I the MLP's inner width, Hq / Hkv heads,
G = Hq / Hkv, D head dim (a power of two).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

QUERY_TILE = 64  # the most queries a split attention program takes (its shared memory)


@triton.jit
def _add_norm(h_ptr, d_ptr, w_ptr, x_ptr, cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < cols
    dt = x_ptr.dtype.element_ty
    at = row * cols + c
    h = tl.load(h_ptr + at, mask=m, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + at, mask=m, other=0.0).to(tl.float32)
    s = (h + d).to(dt)  # the residual stream, rounded as torch's add rounds
    tl.store(h_ptr + at, s, mask=m)
    s = s.to(tl.float32)
    r = tl.rsqrt(tl.sum(s * s, 0) / cols + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(x_ptr + at, ((s * r).to(dt).to(tl.float32) * w).to(dt), mask=m)


@triton.jit
def _silu_mul(gu_ptr, o_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < inner
    dt = o_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * inner + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inner + inner + c, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(o_ptr + row * inner + c, (a * u).to(dt), mask=m)


@triton.jit
def _qk_in(qkv_ptr, qkv_stride, qw_ptr, kw_ptr, eps, cos_ptr, sin_ptr, k_ptr, v_ptr,
           s_slot, s_head, s_pos, slot_ptr, at_ptr, q_ptr, T,
           G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
           D: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads 0 .. HQ-1, then the key heads (their values ride along)
    dt = q_ptr.dtype.element_ty
    c = tl.arange(0, D)
    half = D // 2
    p = (c + half) % D  # rotate_half: x[p], negated in the first half
    row = qkv_ptr + n * qkv_stride + h * D  # a q head at h*D, key head j at (HQ + j)*D
    x = tl.load(row + c).to(tl.float32)
    xp = tl.load(row + p).to(tl.float32)
    if NORM:
        if h < HQ:
            w = tl.load(qw_ptr + c).to(tl.float32)
            wp = tl.load(qw_ptr + p).to(tl.float32)
        else:
            w = tl.load(kw_ptr + c).to(tl.float32)
            wp = tl.load(kw_ptr + p).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        x = ((x * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xp = ((xp * r).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    cos = tl.load(cos_ptr + n * D + c).to(tl.float32)
    sin = tl.load(sin_ptr + n * D + c).to(tl.float32)
    turned = tl.where(c < half, -xp, xp)
    out = ((x * cos).to(dt).to(tl.float32) + (turned * sin).to(dt).to(tl.float32)).to(dt)
    if h < HQ:
        b = n // T
        t = n % T
        q_at = ((b * HKV + h // G) * G * T + (h % G) * T + t) * D
        tl.store(q_ptr + q_at + c, out)
    else:
        j = h - HQ
        at = tl.load(slot_ptr + n) * s_slot + j * s_head + tl.load(at_ptr + n) * s_pos
        tl.store(k_ptr + at + c, out)
        v = tl.load(qkv_ptr + n * qkv_stride + (HQ + HKV + j) * D + c)
        tl.store(v_ptr + at + c, v)


def _on(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current device: make it ``x``'s (a drafter on a second GPU)."""
    if x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def add_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h += delta`` in place, and the RMSNorm of the sum with ``weight``: [N, H] each."""
    if not h.is_contiguous():
        raise ValueError("the residual stream is written in place: it must be contiguous")
    n, cols = h.shape
    block = triton.next_power_of_2(cols)
    x = torch.empty_like(h)
    with _on(h):
        _add_norm[(n,)](h, delta.contiguous(), weight, x, cols, eps, BLOCK=block,
                        num_warps=8 if block >= 2048 else 4)  # fmt: skip
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a product ``gate_up`` [N, 2I] (gate first): [N, I]."""
    n, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(n, inner)
    block = min(1024, triton.next_power_of_2(inner))
    with _on(out):
        _silu_mul[(n, triton.cdiv(inner, block))](gate_up.contiguous(), out, inner, BLOCK=block)
    return out


def qk_in(
    qkv: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    at: torch.Tensor,
    shape: tuple[int, int, int, int, int],
) -> torch.Tensor:
    """From the q/k/v product ``qkv`` [N, (Hq + 2 Hkv) D] (rows contiguous): q and k normed
    (``norms``: q's weight, k's weight, eps; None: no per-head norm) and rotated by ``cos`` /
    ``sin`` [N, D]; each token's key and value written at position ``at`` [N] of slot
    ``slots`` [N] in ``keys`` / ``values`` [S, Hkv, C, D]. ``shape``: (B, T, Hq, Hkv, D).
    Returns q as attention reads it, [B, Hkv, G*T, D]."""
    b, t, hq, hkv, d = shape
    if keys.stride() != values.stride() or keys.stride(3) != 1 or qkv.stride(1) != 1:
        raise ValueError("keys and values in one layout, rows contiguous")
    q = qkv.new_empty(b, hkv, (hq // hkv) * t, d)
    qw, kw, eps = norms if norms is not None else (qkv, qkv, 0.0)
    with _on(q):
        _qk_in[(b * t, hq + hkv)](
            qkv, qkv.stride(0), qw, kw, eps, cos.contiguous(), sin.contiguous(), keys, values,
            keys.stride(0), keys.stride(1), keys.stride(2), slots, at, q, t,
            G=hq // hkv, HQ=hq, HKV=hkv, D=d, NORM=norms is not None,
            num_warps=1 if d <= 128 else 2,
        )  # fmt: skip
    return q


@triton.jit
def _attend_split(q_ptr, k_ptr, v_ptr, limit_ptr, lo_ptr, hi_ptr, o_ptr, ml_ptr, scale, s_slot,
                  s_head, s_pos, HKV: tl.constexpr, M: tl.constexpr, T: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  PREC: tl.constexpr, BAND: tl.constexpr):  # fmt: skip
    # the query tiles vary fastest, so the tiles that read the same keys run side by side
    # (their second reads of them from L2)
    bh = tl.program_id(1).to(tl.int64)  # row b, key head h: bh = b * HKV + h
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    pad = tl.num_programs(0) * BLOCK_M  # the queries' rows in the partial sums, tiles padded
    b = bh // HKV
    h = bh % HKV
    m_at = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this tile's queries
    d_at = tl.arange(0, D)
    real = m_at < M
    q = tl.load(q_ptr + (bh * M + m_at[:, None]) * D + d_at[None, :], mask=real[:, None], other=0.0)
    # query m = g * T + t sees keys j < limit[b, t] (and, with a band, lo <= j < hi)
    limit = tl.load(limit_ptr + b * T + m_at % T, mask=real, other=0)
    span = tl.max(limit, 0)  # the keys this tile's queries see: its splits share them evenly
    if BAND:
        lo = tl.load(lo_ptr + b * T + m_at % T, mask=real, other=0)
        hi = tl.load(hi_ptr + b * T + m_at % T, mask=real, other=0)
        span = tl.maximum(span, tl.max(hi, 0))
    chunk = tl.cdiv(tl.cdiv(span, splits), BLOCK_N) * BLOCK_N
    best = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a split that sees no key adds 0
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    base = b * s_slot + h * s_head
    start = split * chunk
    for step in tl.range(0, chunk, BLOCK_N):  # the chunk's tiles; past the row's keys masked
        j = start + step + tl.arange(0, BLOCK_N)
        inside = j < span
        k = tl.load(
            k_ptr + base + j[:, None] * s_pos + d_at[None, :], mask=inside[:, None], other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        s = s * scale
        sees = j[None, :] < limit[:, None]
        if BAND:
            sees = sees | ((j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None]))
        s = tl.where(sees & inside[None, :], s, float("-inf"))
        new = tl.maximum(best, tl.max(s, 1))
        p = tl.exp(s - new[:, None])
        fade = tl.exp(best - new)
        total = total * fade + tl.sum(p, 1)
        v = tl.load(
            v_ptr + base + j[:, None] * s_pos + d_at[None, :], mask=inside[:, None], other=0.0
        )
        acc = acc * fade[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        best = new
    part = (bh * splits + split) * pad + m_at
    tl.store(o_ptr + part[:, None] * D + d_at[None, :], acc)
    tl.store(ml_ptr + part * 2, best)
    tl.store(ml_ptr + part * 2 + 1, total)


@triton.jit
def _attend_join(part_ptr, ml_ptr, out_ptr, splits, M: tl.constexpr, PAD: tl.constexpr,
                 D: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    d_at = tl.arange(0, D)
    top = tl.load(ml_ptr + (bh * splits * PAD + m) * 2)
    for s in tl.range(1, splits):
        top = tl.maximum(top, tl.load(ml_ptr + ((bh * splits + s) * PAD + m) * 2))
    acc = tl.zeros([D], tl.float32)
    total = top * 0.0
    for s in tl.range(0, splits):
        at = (bh * splits + s) * PAD + m
        w = tl.exp(tl.load(ml_ptr + at * 2) - top)
        total += w * tl.load(ml_ptr + at * 2 + 1)
        acc += w * tl.load(part_ptr + at * D + d_at)
    out = acc / total
    tl.store(out_ptr + (bh * M + m) * D + d_at, out.to(out_ptr.dtype.element_ty))


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    limit: torch.Tensor,
    scale: float,
    splits: int,
    band: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hkv, G*T, D] (query g*T + t) over slots 0 .. B-1 of ``keys`` /
    ``values`` [S, Hkv, C, D], query t of row b seeing the keys before ``limit`` [B, T] and,
    where ``band`` (lo, hi) [B, T] is given, the keys lo .. hi - 1 too (a drafter's block sees
    its prefix and its own slots): the queries in tiles of at most :data:`QUERY_TILE`, each
    tile's keys split into ``splits`` even chunks (of whole 64-key tiles), each chunk's
    softmax-weighted sum in a program of its own, then joined (a decode step at few rows keeps
    every SM reading). Nothing here depends on how many keys a row has: a CUDA graph of it
    serves every context. Returns [B, Hkv, G*T, D] in q's dtype."""
    b, hkv, m, d = q.shape
    t = limit.shape[1]
    if keys.stride() != values.stride() or keys.stride(3) != 1:
        raise ValueError("keys and values in one layout, rows contiguous")
    block_m = min(QUERY_TILE, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(m, block_m)
    pad = tiles * block_m
    part = torch.empty(b * hkv, splits, pad, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(b * hkv, splits, pad, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    lo, hi = (x.contiguous() for x in band) if band is not None else (limit, limit)
    with _on(q):
        _attend_split[(tiles, b * hkv, splits)](
            q.contiguous(), keys, values, limit.contiguous(), lo, hi, part, ml, scale,
            keys.stride(0), keys.stride(1), keys.stride(2), HKV=hkv, M=m, T=t, BLOCK_M=block_m,
            BLOCK_N=64, D=d, num_warps=4, BAND=band is not None,
            PREC="ieee" if q.dtype == torch.float32 else "tf32",  # float32 exact, not TF32
        )  # fmt: skip
        _attend_join[(b * hkv, m)](part, ml, out, splits, M=m, PAD=pad, D=d, num_warps=1)
    return out
