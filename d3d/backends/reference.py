"""The reference backend: the model's own Hugging Face forward over the slab KV.

Nothing is prepared and nothing is fused: keys and values live in the slabs of
:class:`~d3d.backends.kv.RowKV` (no hooks), attention is PyTorch's
``scaled_dot_product_attention`` per group (:mod:`d3d.backends.ragged`). Every other backend is
checked against this one on a sample at load (:mod:`d3d.backends.check`); it runs wherever
neither of them fits (another device, a model of another form, a sample that disagreed).
"""

from __future__ import annotations

from torch import nn

from d3d.backends.clock import WALL, Clock
from d3d.backends.kv import RowKV
from d3d.backends.target import BatchTarget


class ReferenceBackend:
    """See the module docstring. It is also what a backend is (:data:`d3d.backends.Backend`):
    the others extend it, and where their own path does not fit they fall back to its
    :meth:`target`."""

    name = "reference"

    def prepare(self, model: nn.Module) -> None:
        """Ready the target at load, in place (packing, kernels); nothing here."""

    def prepare_drafter(self, model: nn.Module) -> None:
        """Ready a drafter's language model at load, in place; nothing here."""

    def target(
        self,
        model: nn.Module,
        max_kv_tokens: int,
        clock: Clock = WALL,
        rows: int = 32,
        block: int = 16,
    ) -> BatchTarget:
        """A step target over a fresh KV of ``max_kv_tokens`` tokens for at most ``rows`` rows
        at once that verify blocks of ``block`` tokens (the cuda backend's slots and graph
        widths; the slab KV takes any)."""
        return BatchTarget(model, RowKV.for_model(model, max_kv_tokens), clock)
