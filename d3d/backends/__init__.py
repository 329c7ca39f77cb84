"""The seam between the engine and the hardware: how the target runs a step.

A backend owns the target's forward over a step, the KV layout and its writes, and attention;
the engine (:mod:`d3d.engine`) holds one and knows nothing of oneDNN strides, heap settings or
graph buckets. Three exist:

- ``reference`` (:mod:`d3d.backends.reference`): the model's own Hugging Face forward over the
  slab KV, attention in PyTorch's ``scaled_dot_product_attention``; what the others are checked
  against, and what runs where neither fits.
- ``cpu`` (:mod:`d3d.backends.cpu`): every CPU tuning — prepacked linear maps, vLLM's one-pass
  kernels and its paged attention where installed, a lean forward in them, the heap settings,
  the CPU attention paths.
- ``cuda`` (:mod:`d3d.backends.cuda`): a KV of fixed slots, a forward of its own whose decode
  steps (every row adding 1 or K+1 tokens) are captured as CUDA graphs per batch bucket;
  prompt chunks run eagerly.

Each checks itself against the reference on a sample at load (:mod:`d3d.backends.check`) and
falls back to it, with a log line, where the sample disagrees. :func:`choose` picks one by name
(``auto``: by the model's device). Everything here sits on the ground floor of the package: it
imports nothing else of ``d3d``, and the drafter (:mod:`d3d.model`) reads its ragged attention
and KV sizes from here.
"""

from __future__ import annotations

import torch
from torch import nn

from d3d.backends.reference import ReferenceBackend
from d3d.backends.target import BatchTarget

NAMES = ("auto", "reference", "cpu", "cuda")

Backend = ReferenceBackend
"""How the target runs (see the module docstring): ``prepare``, ``prepare_drafter`` and
``target``, as :class:`~d3d.backends.reference.ReferenceBackend` defines them; the cpu and cuda
backends extend it."""


class BackendError(ValueError):
    """A backend that cannot run here (the message says why)."""


def choose(
    name: str = "auto", device: str | torch.device = "cpu", pack: bool = True, fuse: bool = True
) -> Backend:
    """The backend called ``name`` for a target on ``device`` (``auto``: ``cuda`` on a CUDA
    device, ``cpu`` on the CPU, else ``reference``); ``pack`` / ``fuse``: the CPU backend's
    prepacked maps and vLLM kernels."""
    kind = torch.device(device).type
    if name == "auto":
        name = {"cuda": "cuda", "cpu": "cpu"}.get(kind, "reference")
    if name == "reference":
        return ReferenceBackend()
    if name == "cpu":
        if kind != "cpu":
            raise BackendError(f"the cpu backend runs a target on the CPU, not on {device}")
        from d3d.backends.cpu import CpuBackend

        return CpuBackend(pack=pack, fuse=fuse)
    if name == "cuda":
        from d3d.backends.cuda import CudaBackend

        return CudaBackend(graphs=kind == "cuda")
    raise BackendError(f"unknown backend {name!r} (use {', '.join(NAMES)})")


def for_model(model: nn.Module, name: str = "auto") -> Backend:
    """:func:`choose` for ``model``'s device."""
    return choose(name, next(model.parameters()).device)


__all__ = ["NAMES", "Backend", "BackendError", "BatchTarget", "choose", "for_model"]
