"""A step in which no row carries a draft takes vLLM's plain path.

vLLM (0.32) runs every step of an engine configured with a speculative method through its
speculative path: per-row draft metadata, logits gathered by it, and the rejection sampler
(with its kernels) in place of the plain sampler, even when the scheduler gave no row a draft.
On this CPU that path makes a step with no draft longer than the same step without a speculative
configuration, the rejection sampler and the draft metadata first in the profile (measured:
docs/results.md, "Figures from the code's docstrings"). ``auto`` drafts nothing where
speculation does not pay, so it paid exactly this for nothing.

:func:`install` wraps one model runner's ``_prepare_inputs`` (vLLM's only place that decides
between the two paths; the patch is in :mod:`d3d.vllm.patches`): when the step's ``scheduled_spec_decode_tokens`` is empty, it runs with
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

import logging
from dataclasses import dataclass

from d3d.vllm import patches

log = logging.getLogger(__name__)


@dataclass
class StepPaths:
    """How many steps took the plain path (no row had a draft) and the speculative one."""

    plain: int = 0
    speculative: int = 0


def install(runner: object | None) -> StepPaths | None:
    """Route ``runner``'s draft-free steps through the plain path (see the module docstring;
    the patch is :func:`d3d.vllm.patches.wrap_prepare_inputs`). Returns the counts of the paths
    taken, None where it was not installed (no runner too)."""
    if runner is None:
        return None
    paths = StepPaths()

    def plain(scheduler_output: object) -> bool:
        drafts = patches.has_drafts(scheduler_output)
        if drafts:
            paths.speculative += 1
        else:
            paths.plain += 1
        return not drafts

    return paths if patches.wrap_prepare_inputs(runner, plain) else None
