"""A decoder layer's element-wise work in vLLM's one-pass CPU kernels, where vLLM is installed.

Profiled here: the linear maps cost the own engine what they cost vLLM (oneDNN either way), but
the element-wise rest cost several times what it costs vLLM, which compiles it into fused
kernels (measured: docs/results.md, "Figures from the code's docstrings"). Each
RMSNorm is six passes over the hidden states in eager PyTorch (square, mean, add, rsqrt, two
multiplies) and each rotary embedding five per query and key (two multiplies, negate,
concatenate, add). vLLM's CPU build ships both as single kernels (``_C.rms_norm``,
``_C.rotary_embedding``, in place); with them the engine's forward is shorter on prefills and
decode steps alike (measured: docs/results.md, "Figures from the code's docstrings").

:func:`fuse` applies them to one CPU model, in place, and only where a sample shows they compute
what the model's own code computes (to float rounding):

- each RMSNorm module of the form ``weight * x * rsqrt(mean(x^2) + eps)`` (Llama, Qwen2/3,
  Mistral; not Gemma's ``1 + weight``) gets the one-pass kernel as its instance's forward;
- the model's attention modules get a rotary kernel through the modeling module's
  ``apply_rotary_pos_emb``, wrapped so that it runs only while *this* model's forward runs in
  this thread (hooks on the model); any other model of the same architecture in the process keeps
  PyTorch's code, bit for bit.

- where vLLM's CPU attention kernel takes the model's head shape, its attention modules are
  marked for it (:mod:`d3d.backends.cpu.attention`; the engine's KV then stores keys as the kernel
  reads them).

Either falls back to the model's own code for an input it does not fit: autograd wanted, a
device other than the CPU, a layout the kernel does not read (partial rotary, batch rows with
their own positions). Greedy output stays lossless by construction: every decoding mode of the
engine runs the same fused model, as every mode runs the same prepacked linear maps
(:mod:`d3d.backends.cpu.packing`). Without vLLM (or with ``D3D_FUSE=0`` / ``--no-fuse``) nothing changes.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from d3d.backends import check
from d3d.backends.cpu import attention as cpu_attention
from d3d.backends.cpu import vllm_kernels

log = logging.getLogger(__name__)

_state = threading.local()  # depth: fused forwards running in this thread; memo: the rope cache


def available() -> bool:
    """Whether vLLM's CPU kernels can be loaded (its CPU build is installed)."""
    return vllm_kernels.available()


def fuse(model: nn.Module) -> int:
    """Give ``model`` (on the CPU) vLLM's fused kernels in place (module docstring); how many
    modules now use one (0: none, e.g. without vLLM)."""
    if _device(model).type != "cpu" or not available():
        return 0
    norms = [m for m in model.modules() if _is_rms_norm(m)]
    count = sum(_fuse_norm(m) for m in norms)
    count += _fuse_rotary(model)
    count += cpu_attention.enable(model)  # vLLM's attention over the slabs (its KV: keys_t)
    if count:
        _mark_forwards(model)
        log.info("fused kernels: %d modules of %s", count, type(model).__name__)
    return count


# --- RMSNorm ----------------------------------------------------------------------------------


def _is_rms_norm(m: nn.Module) -> bool:
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and isinstance(getattr(m, "variance_epsilon", None), float)
    )


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm instance's forward: one pass; the class's own where the kernel does not fit
    (read from the class, so a deep copy falls back to its own weights)."""
    w = self.weight
    if x.device.type != "cpu" or x.dtype != w.dtype or _wants_grad(x, w):
        return type(self).forward(self, x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops._C.rms_norm(out, x.contiguous(), w, self.variance_epsilon)
    return out


def _fuse_norm(m: nn.Module) -> int:
    if "forward" in m.__dict__:  # fused already (or someone else's forward: leave it)
        return int(getattr(m.forward, "__func__", None) is _norm_forward)
    fused = types.MethodType(_norm_forward, m)
    x = torch.randn(1, 3, 2, m.weight.shape[-1], dtype=m.weight.dtype)
    with torch.no_grad():
        if not agree(lambda: fused(x), lambda: type(m).forward(m, x)):
            log.warning("%s does not match the fused RMSNorm; it keeps its own", type(m).__name__)
            return 0
    m.forward = fused
    return 1


# --- rotary embedding -------------------------------------------------------------------------

_ROPE = "apply_rotary_pos_emb"


def _fuse_rotary(model: nn.Module) -> int:
    """Wrap ``apply_rotary_pos_emb`` in the modeling modules of ``model``'s attention layers;
    how many attention layers it covers (0 where a sample disagrees)."""
    layers = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    modules = {sys.modules.get(type(m).__module__) for m in layers} - {None}
    covered = 0
    for mod in modules:
        original = getattr(mod, _ROPE, None)
        if original is None:
            continue
        if not hasattr(original, "_d3d_original"):
            if not _rope_matches(model, original):
                log.warning("%s's rotary embedding does not match the fused kernel", mod.__name__)
                continue
            setattr(mod, _ROPE, _rope_wrapper(original))
        covered += sum(type(m).__module__ == mod.__name__ for m in layers)
    return covered


def _rope_wrapper(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args: Any, **kwargs: Any):
        if getattr(_state, "depth", 0) and not args and not kwargs and _rope_fits(q, k, cos, sin):
            return _rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._d3d_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rope_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    # q [1, Hq, N, D], k [1, Hkv, N, D] over [1, N, H, D] buffers; cos / sin [1, N, D]
    return (
        q.device.type == "cpu"
        and q.dim() == 4
        and q.shape[0] == 1
        and cos.dim() == 3
        and cos.shape[0] == 1
        and cos.shape[-1] == q.shape[-1] == k.shape[-1]
        and cos.shape[1] == q.shape[2] == k.shape[2]
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.transpose(1, 2).is_contiguous()
        and k.transpose(1, 2).is_contiguous()
        and not _wants_grad(q, k)
    )


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k in place: the kernel reads a [N, D] table (cos | sin halves) at positions
    0 .. N-1, built once per forward (every layer is handed the same cos tensor)."""
    memo = getattr(_state, "memo", None)
    if memo is None or memo[0] is not cos:
        memo = _state.memo = (cos, rope_table(cos, sin), torch.arange(cos.shape[1]))
    _, table, positions = memo
    n, d = q.shape[2], q.shape[3]
    q_rows = q.transpose(1, 2).view(n, -1)
    k_rows = k.transpose(1, 2).view(n, -1)
    torch.ops._C.rotary_embedding(positions, q_rows, k_rows, d, table, True)
    return q, k


def rope_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary kernel's table [N, D] from a rotary embedding's cos / sin [1, N, D]: the
    first halves of cos and sin side by side (the rotation repeats them)."""
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).contiguous()


def _rope_matches(model: nn.Module, original: Callable) -> bool:
    rotary = next(
        (m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None
    )
    attn = next((m for m in model.modules() if hasattr(m, "q_proj")), None)
    d = getattr(attn, "head_dim", None)
    if rotary is None or d is None:
        return False
    dtype = next(model.parameters()).dtype
    n = 7
    x = torch.randn(1, n, 1, dtype=dtype)
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(3, 3 + n)[None])
        q = torch.randn(1, n, 3, d, dtype=dtype).transpose(1, 2)
        k = torch.randn(1, n, 2, d, dtype=dtype).transpose(1, 2)
        if not _rope_fits(q, k, cos, sin):
            return False
        _state.memo = None
        ok = agree(
            lambda: torch.cat([t.flatten() for t in _rope(q.clone(), k.clone(), cos, sin)]),
            lambda: torch.cat([t.flatten() for t in original(q, k, cos, sin)]),
        )
        _state.memo = None
    return ok


# --- which forwards run fused -----------------------------------------------------------------


def _mark_forwards(model: nn.Module) -> None:
    """While ``model``'s forward runs in a thread, that thread's rotary calls may be fused."""
    if getattr(model, "_d3d_fused", False):
        return

    def enter(module, args, kwargs=None):
        _state.depth = getattr(_state, "depth", 0) + 1
        _state.memo = None

    def leave(module, args, output):
        _state.depth -= 1
        _state.memo = None

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    model._d3d_fused = True


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _wants_grad(*xs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def agree(fused: Callable[[], torch.Tensor], own: Callable[[], torch.Tensor]) -> bool:
    """Whether a fused kernel's (or forward's) result on a sample is the model's own, to float
    rounding (:func:`d3d.backends.check.relative_error` within its ``TOLERANCE``; a kernel that
    refuses the sample does not agree)."""
    try:
        got = fused()
    except RuntimeError as e:
        log.warning("a fused kernel refused a sample: %s", e)
        return False
    want = own()
    if got.shape != want.shape:
        return False
    return check.relative_error(got, want) <= check.TOLERANCE
