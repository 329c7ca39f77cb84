"""The CUDA backend: the target's decode steps replayed as CUDA graphs over a fixed-slot KV.

- :mod:`~d3d.backends.cuda.kv`         one slab of fixed slots, allocated once (graphs address it)
- :mod:`~d3d.backends.cuda.forward`    the decode step of a Llama-family model over those slots
- :mod:`~d3d.backends.cuda.graphs`     a graph per (rows, width, keys attended), captured on use
- :mod:`~d3d.backends.cuda.rehearsal`  the graphs as a replay runs them, checked, on a CPU
- :mod:`~d3d.backends.cuda.target`     which steps replay a graph and which run eagerly
- :mod:`~d3d.backends.cuda.drafter`    the drafter worker's slot KV and packed step (blocks and
  branches of every row in one forward, captured per shape; :mod:`~d3d.backends.cuda.drafter_step`)

:class:`CudaBackend` builds the step target and proves it at load: a sample of two rows read
eagerly, then a plain step and a K+1-token verify step through the decode path (captured, on a
GPU), each step's logits against the reference backend's (:mod:`d3d.backends.check`). A model of
another form, a sample that disagrees, or a sample that raises (a capture the device refused, a
kernel that does not take the shapes) runs the reference backend, with the reason logged; only a
disagreement can be overridden (``trust``), never a sample that did not run.
``graphs=False`` runs the same step code without capturing it; ``graphs=True`` on a CPU
rehearses the graphs (:mod:`~d3d.backends.cuda.rehearsal`: each call held to its shape's first,
as a replay would run it): how the tests prove the decode path token for token here.
"""

from __future__ import annotations

import logging
import weakref

from torch import nn

from d3d.backends import check
from d3d.backends.clock import WALL, Clock
from d3d.backends.cuda.drafter import PackedPlan, mark
from d3d.backends.cuda.forward import unfit
from d3d.backends.cuda.fused import fuse_projections
from d3d.backends.cuda.kv import MIN_CAPACITY, StaticKV
from d3d.backends.cuda.target import BUCKETS, CudaTarget
from d3d.backends.reference import ReferenceBackend
from d3d.backends.target import BatchTarget

log = logging.getLogger(__name__)

SAMPLE_BLOCK = 16  # the load-time sample's verify width
_ERRORS: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()
_FAILED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # why it raised


class CudaBackend(ReferenceBackend):
    """See the module docstring."""

    name = "cuda"

    def __init__(self, graphs: bool = True, trust: bool = False):
        """``trust``: run the decode path even where the sample disagrees (a measurement that
        must time this path; :meth:`report` says how far the sample was)."""
        self.graphs, self.trust = graphs, trust

    def prepare(self, model: nn.Module) -> None:
        """Lay the projections out for one product each (:func:`~d3d.backends.cuda.fused.
        fuse_projections`: before a drafter shares the layers, so it shares the layout); the
        graphs are captured by each step target, on first use."""
        why = unfit(model)
        if why:
            log.warning("the cuda backend cannot run %s (%s): the reference runs it",
                        type(model).__name__, why)  # fmt: skip
            return
        fuse_projections(model)

    def prepare_drafter(self, model: nn.Module) -> None:
        """Have the drafter worker draft through this backend's packed step
        (:mod:`d3d.backends.cuda.drafter`), where the drafter's language model fits it (one
        with no weights, the replay instrument's without a shape, drafts nothing)."""
        if next(model.parameters(), None) is None:
            return
        why = unfit(model)
        if why:
            log.warning("the cuda backend cannot run the drafter %s (%s): it drafts row by row",
                        type(model).__name__, why)  # fmt: skip
            return
        fuse_projections(model)  # a drafter sharing the target's layers shares their layout
        mark(model, PackedPlan(graphs=self.graphs))

    def target(
        self,
        model: nn.Module,
        max_kv_tokens: int,
        clock: Clock = WALL,
        rows: int = 32,
        block: int = 16,
    ) -> BatchTarget:
        """A :class:`CudaTarget` for at most ``rows`` rows at once over ``max_kv_tokens``, or the
        reference's target where the model does not fit or its sample disagrees."""
        if unfit(model) or not (self._agrees(model) or self._trusted(model)):
            return super().target(model, max_kv_tokens, clock)
        return self._target(model, max_kv_tokens, clock, rows, block)

    def _target(
        self, model: nn.Module, max_kv_tokens: int, clock: Clock, rows: int, block: int
    ) -> CudaTarget:
        kv = StaticKV.shaped(model, max_kv_tokens, rows)
        return CudaTarget(model, kv, clock, block, self.graphs)

    def report(self, model: nn.Module) -> dict:
        """The load-time sample's largest relative error against the reference, the dtype's
        tolerance and the verdict (the sample runs on first use)."""
        err = self._error(model)
        limit = check.tolerance(next(model.parameters()).dtype)
        out = {"relative_error": err, "tolerance": limit, "agrees": err <= limit}
        if model in _FAILED:
            out["failed"] = _FAILED[model]
        return out

    def _trusted(self, model: nn.Module) -> bool:
        """Run the decode path whatever the sample's error: ``trust``, and the sample ran."""
        return self.trust and model not in _FAILED

    def _agrees(self, model: nn.Module) -> bool:
        ok = self.report(model)["agrees"]
        if not ok:
            log.warning("the cuda backend's sample differs from the reference: %s%s",
                        self.report(model), "; running it anyway" if self._trusted(model) else "")  # fmt: skip
        return ok

    def _error(self, model: nn.Module) -> float:
        """Eager prompt chunks, then a plain and a verify step on the decode path, against the
        reference (once per model; inf where the decode path did not run)."""
        if model not in _ERRORS:
            try:
                t = self._target(model, 2 * MIN_CAPACITY, WALL, 2, SAMPLE_BLOCK)
                schedule = ((5, 3), (1, 1), (SAMPLE_BLOCK, SAMPLE_BLOCK))
                err = check.sample_error(model, check.steps_of(t), schedule)
                _ERRORS[model] = err if t.counts["decode"] == 2 else float("inf")
            except Exception as exc:  # the reference runs the model; the reason is logged
                log.exception("the cuda backend's sample failed")
                _FAILED[model] = f"{type(exc).__name__}: {exc}"
                _ERRORS[model] = float("inf")
        return _ERRORS[model]


__all__ = ["BUCKETS", "CudaBackend", "CudaTarget", "StaticKV"]
