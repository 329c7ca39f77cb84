"""Which Triton kernels a cuda step takes (:mod:`d3d.backends.cuda.kernels`), each proven by a
sample before it is taken.

A kernel replaces a chain of torch forms (:mod:`d3d.backends.cuda.fused`) only where those forms
are in place for the model — torch's ``rms_norm`` for every norm, q/k/v and gate/up laid out as
one product each, q and k rotated by the rotate-half rule, a power-of-two head size — and where
it computes what they compute on a random sample on the model's own device and dtype: a kernel
that computes something else, or that does not compile or launch there (raises), is not taken
and the step keeps the torch forms. :class:`Kernels` records the choice (the GPU check reports
it); :func:`kernels_for` finds the kernels module, which imports Triton, only where it can run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from d3d.backends.cuda.fused import GateUpMlp, RmsNorm, close, rotate_together

StaticForward = Any  # a d3d.backends.cuda.forward.StaticForward (not imported: it imports this)


@dataclass
class Kernels:
    """The Triton kernels a step takes: ``module`` (None: none), the residual add and norm as
    one kernel (``add_norm``, every layer or none), per layer the q/k path and the MLP's
    activation, and attention split over the keys (``attend``: a step over slots in place
    whose queries each see their row's first keys and, the drafter's blocks, a band)."""

    module: ModuleType | None
    add_norm: bool
    qk_in: list[bool]
    silu_mul: list[bool]
    attend: bool = False

    @classmethod
    def none(cls, layers: int) -> Kernels:
        """No kernel: the torch forms throughout."""
        return cls(None, False, [False] * layers, [False] * layers)


def kernels_for(device: torch.device) -> ModuleType | None:
    """:mod:`d3d.backends.cuda.kernels` where its Triton kernels can run on ``device``: a GPU
    with Triton, or any device under ``TRITON_INTERPRET=1`` (Triton's interpreter, the tests);
    else None. ``D3D_CUDA_KERNELS=0`` turns them off (the torch forms throughout: a way round
    a kernel that misbehaves on a GPU its sample could not catch, a device fault)."""
    if os.environ.get("D3D_CUDA_KERNELS", "1") == "0":
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from d3d.backends.cuda import kernels
    except Exception:  # no Triton, or one that cannot load here: the torch forms
        return None
    return kernels


@torch.inference_mode()
def add_norm_agrees(kernels: ModuleType, norm: RmsNorm) -> bool:
    """Whether ``kernels.add_norm`` computes ``h + delta`` and ``norm`` of it on a sample."""
    gen = torch.Generator().manual_seed(3)
    w = norm.weight
    h, d = (torch.randn(3, w.shape[0], generator=gen).to(w.device, w.dtype) for _ in "hd")
    want = h + d
    return _agree(lambda: kernels.add_norm(h, d, w, norm.eps), lambda: norm(want), h, want)


@torch.inference_mode()
def silu_mul_agrees(kernels: ModuleType, mlp: GateUpMlp) -> bool:
    """Whether ``kernels.silu_mul`` computes ``mlp``'s activation of gate times up on a sample."""
    gen = torch.Generator().manual_seed(4)
    w = mlp.gate_up
    gu = (torch.randn(3, w.shape[0], generator=gen) * 4).to(w.device, w.dtype)
    g, u = gu.split(mlp.inner, -1)
    return _agree(lambda: kernels.silu_mul(gu), lambda: mlp.act(g) * u)


def _agree(got: Callable, want: Callable, *pairs: torch.Tensor) -> bool:
    """``got()`` and ``want()`` close, and each pair of ``pairs`` too, after both ran; False
    where the kernel raises (it cannot run here)."""
    try:
        a = got()
    except Exception:  # a kernel that does not compile or launch on this device
        return False
    b = want()
    return close(a, b) and all(close(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))


def take(step: StaticForward, device: torch.device) -> Kernels:
    """The Triton kernels this step takes (:mod:`d3d.backends.cuda.kernels`): each where the
    torch forms it replaces are in place (fused norms, laid-out products, the rotation of q
    and k together) and a sample on the model's device and dtype agrees."""
    n = len(step.layers)
    none = Kernels.none(n)
    module = kernels_for(device)
    if module is None or not n or step.rotate is not rotate_together or step.d & (step.d - 1):
        return none
    norms = [*(x for pair in step.norms for x in pair), step.final_norm]
    add = all(isinstance(x, RmsNorm) for x in norms) and add_norm_agrees(module, norms[1])
    silu = [isinstance(m, GateUpMlp) and silu_mul_agrees(module, m) for m in step.mlps]
    qk = [
        w is not None
        and (qn is None or (isinstance(qn[0], RmsNorm) and isinstance(qn[1], RmsNorm)
                            and qn[0].eps == qn[1].eps))
        for w, qn in zip(step.qkv, step.qk_norms, strict=True)
    ]  # fmt: skip
    if any(qk) and not _qk_in_agrees(step, module, qk.index(True), device):
        qk = [False] * n
    return Kernels(module, add, qk, silu, _attend_agrees(step, module, device))


@torch.inference_mode()
def _attend_agrees(step: StaticForward, module: ModuleType, device: torch.device) -> bool:
    """Whether ``module.attend`` computes this step's SDPA call on two samples in 3 and 2
    chunks: 2 rows of 3 queries a key head seeing the keys before a bound (the target's; the
    longer row's 302 keys of its slot's 384), and a row of two tiles of queries each seeing a
    prefix and a band of its own (the drafter's blocks) in a slot of 128."""
    hkv, g, d = step.hkv, step.hq // step.hkv, step.d
    dtype = step.dtype
    gen = torch.Generator().manual_seed(6)

    def agrees(limit: torch.Tensor, band: tuple | None, keys: int, splits: int) -> bool:
        kv = [torch.randn(3, hkv, keys, d, generator=gen).to(device, dtype) for _ in "kv"]
        rows = limit.shape[0]
        q = torch.randn(rows, hkv, g * limit.shape[1], d, generator=gen).to(device, dtype)
        mask = step.mask(step.seen(limit, band, keys), dtype)
        return _agree(
            lambda: module.attend(q, kv[0], kv[1], limit, step.scaling, splits, band),
            lambda: F.scaled_dot_product_attention(
                q, kv[0][:rows], kv[1][:rows], mask, scale=step.scaling
            ),
        )

    t = -(-65 // g)  # queries a key head past one tile (64)
    lo = torch.randint(0, 112, (1, t), generator=gen)
    hi = lo + torch.randint(0, 17, (1, t), generator=gen)
    limit = torch.randint(1, 100, (1, t), generator=gen)
    target = torch.tensor([[5, 6, 7], [300, 301, 302]], device=device)
    return agrees(target, None, 384, 3) and agrees(
        limit.to(device), (lo.to(device), hi.to(device)), 128, 2
    )


@torch.inference_mode()
def _qk_in_agrees(step: StaticForward, module: ModuleType, i: int, device: torch.device) -> bool:
    """Whether ``module.qk_in`` does what :meth:`StaticForward.qk_torch` does for layer i on a sample:
    2 rows of 3 tokens, into scratch slots."""
    hq, hkv, d = step.hq, step.hkv, step.d
    dtype = step.qkv[i].dtype
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
    pos = torch.tensor([[3, 4, 5, 0, 1, 2]], device=device)
    cos, sin = step.inner.rotary_emb(qkv[None], pos)
    write = torch.tensor([1, 1, 1, 0, 0, 0], device=device)
    shape = (2, 3, hq, hkv, d)
    caches = [torch.zeros(2, 2, hkv, 8, d, dtype=dtype, device=device) for _ in "ab"]
    parts = qkv.split([hq * d, hkv * d, hkv * d], -1)
    want = step.qk_torch(i, parts, cos, sin, (caches[0][0], caches[0][1]), write, pos[0], shape)
    norms = step.qk_norm_args(i)
    kernel = (qkv, norms, cos[0], sin[0], caches[1][0], caches[1][1], write, pos[0], shape)
    return _agree(lambda: module.qk_in(*kernel), lambda: want, caches[1], caches[0])
