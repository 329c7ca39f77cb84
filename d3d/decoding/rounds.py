"""A speculative round's bookkeeping, one protocol for both engines: propose, observe, record.

Every round under the own scheduler (:mod:`d3d.engine.scheduler`) and under vLLM
(:class:`d3d.vllm.rows.RequestRows`) goes the same way::

    proposal = proposer.propose(tokens)                   # K drafts (maybe none)
    ... the target verifies [anchor, d_1..d_K] in a batched forward, accepts, commits ...
    proposer.observe(acc, round_seconds(K, widest, prompts, forward_s))
    stats.record(round_record(proposal, K, acc, emitted, forward_s, step_s))

:func:`round_seconds` is the one rule for the time a round's proposer (and, through its commit,
the drafter worker's branch budget, :mod:`d3d.worker.budget`) observes: the step's forward time
when the round verified as many drafts as the step's widest round did and the forward read no
prompt, else None (the forward was not this round's alone). :func:`round_record` is the one
record of what a round drafted, accepted, hit and cost.
"""

from __future__ import annotations

from d3d.decoding.proposers import NO_DRAFT, Proposal
from d3d.decoding.stats import Round
from d3d.decoding.verify import Acceptance


def round_seconds(drafts: int, widest: int, prompts: bool, seconds: float | None) -> float | None:
    """A round's target time as its proposer observes it (see the module docstring). A proposer
    that prices its rounds tells a batch's time from its own by the share it was given; the
    worker needs the batch's."""
    return seconds if drafts == widest and not prompts else None


def round_record(
    proposal: Proposal | None,
    drafts: int,
    acc: Acceptance,
    emitted: list[int],
    verify_s: float,
    step_s: float = 0.0,
) -> Round:
    """The record of one round: ``proposal`` as proposed (None: the host kept none), of which
    the target verified ``drafts``; ``emitted``: the tokens the round committed (after stops
    and the budget); ``step_s``: the whole step where every drafting row in it hit, else 0."""
    p = proposal if proposal is not None else NO_DRAFT
    return Round(
        emitted,
        drafts,
        acc.num_accepted,
        p.wait_s,
        verify_s,
        p.hit if drafts else None,
        p.branches,
        speculative=drafts > 0,
        failed=p.failed,
        copied=p.source == "copy" and drafts > 0,
        step_s=step_s,
    )


__all__ = ["round_record", "round_seconds"]
