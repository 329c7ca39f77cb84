"""Fewer kernels a layer for the cuda backend's step: the model's norms and rotary rule, fused
where a sample proves the fused form computes what the model's own code does.

A decode step at one row is a few milliseconds of weight reads spread over thousands of kernels;
inside a CUDA graph each kernel still costs a launch and a minimum run of a couple of
microseconds, so the elementwise chains of eager transformers code are most of what a graph
cannot remove. Per layer, the model's RMSNorm is seven of them (cast, square, mean, rsqrt,
multiply, cast, scale), run four times in Qwen3 (input, q heads, k heads, post-attention), and
its rotary rule five for q and five for k. Here:

- :func:`norm_of` gives ``torch.nn.functional.rms_norm`` with the module's weight and epsilon
  (one fused kernel on a GPU) in place of a norm module, where it agrees with the module on a
  random sample in the module's dtype; else the module itself.
- :func:`rope_of` gives a rotary step that rotates q and k together (one concatenation, one
  rotation) in place of the model's ``apply_rotary_pos_emb`` called on each, where the two
  agree on a sample; else a step that calls the model's rule.
- :func:`fuse_projections` (the backend's ``prepare``, before anything else holds the weights)
  lays each layer's q, k and v weights one after another in one storage, and its MLP's gate and
  up, the modules keeping views of it (no new memory once the old tensors are freed; a drafter
  sharing the layers then shares the views). :func:`joined` finds such a layout, so the step
  runs one matrix product for q, k and v and one for gate and up: larger products read the
  weights closer to the memory's rate at one row than three or two small ones. A group with a
  hook on one of its modules (a drafter's gated adapters, :mod:`d3d.model.adapters`) keeps its
  module calls: one product would skip the hook.

The samples are the guard against a model whose norm or rule is of another form (a norm that
scales by 1 + weight, an interleaved or partial rotation): it keeps its own code. Agreement is
up to rounding: the fused norm rounds once where the module rounds after normalising and again
after scaling, so in bf16 they may differ in the last bit; in float32 they agree to 1e-5.

Letters: N new tokens, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Rope = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]  # (q [N, Hq, D], k [N, Hkv, D], cos, sin [1, N, D]) -> rotated q, k, same shapes


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of their dtype, relative to the larger of the two."""
    tol = 1e-5 if a.dtype == torch.float32 else 1e-2
    scale = max(float(a.float().abs().max()), float(b.float().abs().max()), 1e-6)
    return float((a.float() - b.float()).abs().max()) <= tol * scale


@torch.inference_mode()
def norm_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s RMSNorm as one fused call, or ``module`` where the two differ (module
    docstring)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return module
    fused = RmsNorm(weight, float(eps))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, weight.shape[0], generator=gen).to(weight.device, weight.dtype)
    return fused if close(fused(x), module(x)) else module


class RmsNorm:
    """torch's one-kernel ``rms_norm`` with a norm module's ``weight`` and ``eps``."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps, self.shape = weight, eps, (weight.shape[0],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


def rotate_together(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D] and k [N, Hkv, D] rotated by ``cos`` / ``sin`` [1, N, D] in one pass (the
    rotate-half rule of Llama-family models), as :func:`rope_of` takes it where it agrees."""
    hq = q.shape[1]
    qk = torch.cat([q, k], 1)  # [N, Hq + Hkv, D]
    c, s = cos[0][:, None], sin[0][:, None]  # [N, 1, D]
    half = qk.shape[-1] // 2
    turned = torch.cat([-qk[..., half:], qk[..., :half]], -1)
    qk = qk * c + turned * s
    return qk[:, :hq], qk[:, hq:]


def own_rope(rule: Callable) -> Rope:
    """The model's ``apply_rotary_pos_emb`` as a rotary step (in its layout, [1, H, N, D])."""

    def own(q, k, cos, sin):
        q4, k4 = rule(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q4[0].transpose(0, 1), k4[0].transpose(0, 1)

    return own


@torch.inference_mode()
def rope_of(rule: Callable, rotary: nn.Module, dtype: torch.dtype, hq: int, hkv: int,
            d: int) -> Rope:  # fmt: skip
    """The rotary step for the model whose ``apply_rotary_pos_emb`` is ``rule`` and whose
    rotary table is ``rotary``: q and k rotated together where that agrees with ``rule`` on a
    sample of the table's own angles, else ``rule`` on each (module docstring)."""

    own = own_rope(rule)
    device = next(iter(rotary.buffers())).device
    gen = torch.Generator().manual_seed(1)
    n = 5
    q, k = (torch.randn(n, h, d, generator=gen).to(device, dtype) for h in (hq, hkv))
    pos = torch.randint(0, 4096, (1, n), generator=gen).to(device)
    cos, sin = rotary(q[None, :, 0], pos)  # [1, N, D'] in q's dtype
    if cos.shape[-1] != d:  # a partial rotation: the model's rule knows which part
        return own
    a, b = rotate_together(q, k, cos, sin), own(q, k, cos, sin)
    same = all(close(x, y) for x, y in zip(a, b, strict=True))
    return rotate_together if same else own


def joined(*weights: torch.Tensor) -> torch.Tensor | None:
    """``weights`` as one [rows, cols] matrix, where they lie one after another in one storage
    (as :func:`fuse_projections` leaves them); None otherwise."""
    first = weights[0]
    if any(
        w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype
        or not w.is_contiguous()
        or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        for w in weights
    ):  # fmt: skip
        return None
    at = first.storage_offset()
    for w in weights:
        if w.storage_offset() != at:
            return None
        at += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())


def _groups(layer: nn.Module) -> list[tuple[nn.Module, ...]]:
    a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    out = []
    for owner, names in ((a, ("q_proj", "k_proj", "v_proj")), (m, ("gate_proj", "up_proj"))):
        mods = tuple(getattr(owner, n, None) for n in names)
        if all(isinstance(x, nn.Linear) and x.bias is None for x in mods):
            out.append(mods)
    return out


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its weight: a forward hook or pre-hook (a
    drafter's gated adapters are hooks on these projections, d3d.model.adapters)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Lay each decoder layer's bias-free q, k, v weights, and its MLP's gate and up, one after
    another in one storage, the modules keeping views (module docstring). Returns the groups
    laid out now (a group already laid out is left as it is)."""
    done = 0
    for layer in model.model.layers:
        for mods in _groups(layer):
            if joined(*(x.weight for x in mods)) is not None:
                continue
            whole = torch.cat([x.weight for x in mods])
            start = 0
            for x in mods:
                rows = x.weight.shape[0]
                x.weight = nn.Parameter(whole[start : start + rows], requires_grad=False)
                start += rows
            done += 1
    return done


def laid_out(layer: nn.Module, first: nn.Module | None) -> torch.Tensor | None:
    """The weights of ``layer``'s bias-free group that begins with ``first`` (its ``q_proj`` or
    its MLP's ``gate_proj``) as one matrix, where :func:`fuse_projections` laid them out and no
    module of the group has a hook (one product would skip it: a drafter's adapters)."""
    for mods in _groups(layer):
        if first is not None and mods[0] is first and not any(_hooked(x) for x in mods):
            return joined(*(x.weight for x in mods))
    return None


@torch.inference_mode()
def mlp_of(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's MLP as one product for gate and up, where its weights are :func:`laid_out`
    and that agrees with the module on a sample (an MLP of another form keeps its own code)."""
    mlp = layer.mlp
    gate_up = laid_out(layer, getattr(mlp, "gate_proj", None))
    act, down = getattr(mlp, "act_fn", None), getattr(mlp, "down_proj", None)
    if gate_up is None or act is None or down is None:
        return mlp
    fused = GateUpMlp(gate_up, act, down)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, gate_up.shape[1], generator=gen).to(gate_up.device, gate_up.dtype)
    return fused if close(fused(x), mlp(x)) else mlp


class GateUpMlp:
    """A gated MLP as one product for gate and up (``gate_up`` [2I, H], gate first), the
    model's activation ``act`` and its ``down`` projection."""

    def __init__(self, gate_up: torch.Tensor, act: Callable, down: Callable):
        self.gate_up, self.act, self.down = gate_up, act, down
        self.inner = gate_up.shape[0] // 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, self.gate_up).split(self.inner, -1)
        return self.down(self.act(g) * u)
