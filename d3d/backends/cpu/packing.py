"""Linear maps with weights prepacked for oneDNN, for inference on a CPU.

``F.linear`` on a CPU hands each call to a BLAS that reads the weight in its stored layout; for
the few rows of a decode step or a verify forward that layout is what costs. oneDNN can keep
the weight in the blocked layout its kernels read (packed once, at load), which makes verify
forwards and prefills shorter (``d3d bench`` prints the forwards' times). For one or two rows (a
lone request's decode step) the packed kernel is the slower one (from four rows on packing
wins), so those inputs read the weight as stored (``SMALL``) (measured: docs/results.md,
"Figures from the code's docstrings").

Where vLLM's CPU build is installed, the packed copy is vLLM's oneDNN matmul handler rather than
torch's (``create_onednn_mm``: the same library, with a primitive cached per input size): in the
engine's forward it makes mid-sized decode steps shorter than torch's
``mkldnn._linear_pointwise`` (large batches and prefill about the same; measured:
docs/results.md, "Figures from the code's docstrings"), because torch sets up each call's
primitive anew. Its calls go through :mod:`d3d.backends.cpu.onednn`, which keeps a primitive
for each thread budget (vLLM's cache would otherwise keep one built for the reduced budget of a
speculative step and run later full-budget steps of that size on fewer threads).

:func:`pack_linears` turns a model's ``nn.Linear`` modules into :class:`PackedLinear` in place
(the same module objects: hooks, state-dict keys and ``isinstance`` checks stay as they were).
A packed module computes the same map; its float results may differ from ``F.linear``'s in the
last bits (another summation order), as a decode step's already differ from a verify forward's,
so every decoding mode of an engine runs the same packed target and stays lossless against
plain decoding of it. It falls back to ``F.linear`` whenever the packed copy may be wrong or
unfit: gradients wanted, another dtype or device, or a weight changed since packing (its
version counter moved). A deep copy of a packed module is a plain ``nn.Linear``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from d3d.backends.cpu import fused, onednn, vllm_kernels

log = logging.getLogger(__name__)

SMALL = 2  # inputs of at most this many rows read the unpacked weight (module docstring)


def available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that computes with a oneDNN-packed copy of its weight (module docstring)."""

    _packed: torch.Tensor | None  # torch's packed weight (None: vLLM's handler packs it)
    _handler: Any  # vLLM's oneDNN matmul handler, or None
    _packed_version: int

    def pack(self, vllm: bool = False) -> None:
        w = self.weight.detach()
        self._handler = _vllm_handler(w) if vllm else None
        self._packed = None if self._handler else torch.ops.mkldnn._reorder_linear_weight(w, None)
        self._packed_version = self.weight._version

    def _fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and self.weight._version == self._packed_version
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= SMALL * x.shape[-1] or not self._fits(x):
            return F.linear(x, self.weight, self.bias)
        if self._handler is not None:
            return onednn.mm(self._handler, x, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        out = nn.Linear.__new__(nn.Linear)
        memo[id(self)] = out
        state = {
            k: copy.deepcopy(v, memo)
            for k, v in self.__dict__.items()
            if k not in ("_packed", "_handler", "_packed_version")
        }
        out.__setstate__(state)
        return out


def _vllm_handler(w: torch.Tensor) -> Any:
    """vLLM's oneDNN matmul handler over ``w`` [N, K], or None (no vLLM CPU build, or it refuses)."""
    if not fused.available():
        return None
    try:
        return onednn.handler(w.t()) if vllm_kernels.supports_onednn() else None
    except (ImportError, AttributeError, RuntimeError) as e:
        log.warning("vLLM's oneDNN matmul handler is unavailable (%s); torch's packing is used", e)
        return None


def pack_linears(model: nn.Module, vllm: bool = False) -> int:
    """Pack every float32 CPU ``nn.Linear`` of ``model`` in place; how many were packed.
    Nothing happens (0) where this torch build cannot pack. ``vllm``: with vLLM's matmul
    handler where vLLM's CPU build is installed (module docstring)."""
    if not available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            continue
        module.__class__ = PackedLinear
        try:
            module.pack(vllm)  # type: ignore[attr-defined]
        except RuntimeError:  # a shape or build oneDNN refuses: keep the plain map
            module.__class__ = nn.Linear
            log.warning("could not pack a %s linear map; it stays unpacked", tuple(w.shape))
            continue
        count += 1
    return count
