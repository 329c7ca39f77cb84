"""Triton kernels for the cuda backend's decode step: the elementwise chains between its matrix
products, one kernel each, so a captured step launches about half the kernels a layer.

Inside a CUDA graph a kernel still costs a launch slot and a minimum run of a few microseconds;
after :mod:`d3d.backends.cuda.fused` a Qwen3 layer is four products, an attention call and about
nineteen small kernels, and at one row those small kernels are a fifth of the step. Three
kernels take their place:

- :func:`add_norm`: the residual add and the next RMSNorm (``h += delta``; ``x = norm(h)``),
  twice a layer: four kernels become two.
- :func:`qk_in`: what lies between the q/k/v product and attention — the per-head RMSNorm of q
  and k (Qwen3), the rotation of both, the new keys and values written into their slots, and q
  laid out as attention reads it ([B, Hkv, G*T, D]): about eleven kernels become one.
- :func:`silu_mul`: the MLP's ``silu(gate) * up``: two kernels become one.

Each rounds where the model's own code rounds (the sum before the norm, the normalised value
before its weight, each product of the rotation before their sum), so it agrees with the torch
forms it replaces to the last bit or so; the step takes a kernel only where a sample on the
model's device and dtype agrees (``StaticForward``). This module imports Triton: it is imported
by :func:`d3d.backends.cuda.fused.kernels_for` only where a GPU runs it, or where
``TRITON_INTERPRET=1`` runs it on the CPU (the tests).

Letters: N new tokens (B rows of T), H hidden, I the MLP's inner width, Hq / Hkv heads,
G = Hq / Hkv, D head dim (a power of two).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


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
