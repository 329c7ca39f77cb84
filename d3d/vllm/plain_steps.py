"""A step in which no row carries a draft takes vLLM's plain path.

vLLM (0.32) runs every step of an engine configured with a speculative method through its
speculative path: per-row draft metadata, logits gathered by it, and the rejection sampler
(with its kernels) in place of the plain sampler, even when the scheduler gave no row a draft.
Measured on this CPU (``vllm.LLM``, the embedded model, a proposer that never drafts, against
no speculative configuration): 1.8 ms a step at one row (+4 %), 1-3 % at 16 rows, and the
profile puts the rejection sampler and the draft metadata first. ``auto`` drafts nothing where
speculation does not pay, so it paid exactly this for nothing.

:func:`install` wraps one model runner's ``_prepare_inputs`` (vLLM's only place that decides
between the two paths): when the step's ``scheduled_spec_decode_tokens`` is empty, it runs with
the runner's ``speculative_config`` hidden, so that step builds no draft metadata and samples
with the plain sampler; everything after it (the proposer's call, the draft bookkeeping) sees
the configuration as before. With no draft, the rejection sampler's output is the plain
sampler's (greedy: the argmax; sampled: a draw from the same distribution), so nothing changes
but the cost. Hybrid (recurrent) models are left alone: their state update after a step reads
the speculative path's per-row counts. A runner whose method does not look as expected (another
vLLM) is left alone too, with a warning. :class:`StepPaths` counts the steps each path took
(the proposer's totals: ``plain_steps``, ``speculative_steps``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class StepPaths:
    """How many steps took the plain path (no row had a draft) and the speculative one."""

    plain: int = 0
    speculative: int = 0


def install(runner: object | None) -> StepPaths | None:
    """Route ``runner``'s draft-free steps through the plain path (see the module docstring).
    Returns the counts of the paths taken, None where it was not installed (no runner too)."""
    prepare = getattr(runner, "_prepare_inputs", None)
    if prepare is None or getattr(getattr(runner, "model_config", None), "is_hybrid", False):
        return None
    params = list(inspect.signature(prepare).parameters)
    if not params or params[0] != "scheduler_output" or not hasattr(runner, "speculative_config"):
        log.warning("D3D proposer: vLLM's _prepare_inputs changed; draft-free steps keep its path")
        return None
    paths = StepPaths()

    @functools.wraps(prepare)
    def prepare_inputs(scheduler_output, *args, **kwargs):
        spec = runner.speculative_config
        if spec is None or scheduler_output.scheduled_spec_decode_tokens:
            paths.speculative += 1
            return prepare(scheduler_output, *args, **kwargs)
        paths.plain += 1
        runner.speculative_config = None
        try:
            return prepare(scheduler_output, *args, **kwargs)
        finally:
            runner.speculative_config = spec

    runner._prepare_inputs = prepare_inputs  # type: ignore[attr-defined]
    return paths
