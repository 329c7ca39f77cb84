"""One request's proposer for its mode, the same for every engine that hosts D3D.

``ar`` proposes nothing; ``async`` takes the blocks the drafter worker prepares while the target
verifies (:class:`~d3d.worker.proposer.AsyncProposer`); ``sync`` drafts on the critical path:
with the drafter itself where the engine's process holds it (the own engine's
:class:`~d3d.decoding.proposers.SyncProposer`, a forward per row), else on the worker with no
branches prepared — an engine whose process must not hold a drafter (vLLM's model runner), or a
worker that drafts every row's block of a step in one forward (``sync_on_worker``: the cuda
backend's packed, captured drafting, against an eager forward per row in this process); ``auto``
speculates through the async (else sync) proposer only where the policy says it pays
(:class:`~d3d.decoding.policy.AutoProposer`), with copy rounds from the request's own text.
The own engine (:meth:`d3d.engine.Engine.proposer`) and the vLLM proposer
(:mod:`d3d.vllm.proposer`) both build their proposers here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from d3d.backends.clock import WALL, Clock
from d3d.decoding.lookup import CopyDrafts
from d3d.decoding.policy import AutoProposer, HostCosts
from d3d.decoding.proposers import ArProposer, Proposer, SyncProposer
from d3d.model.drafter import DrafterError
from d3d.worker.proposer import AsyncProposer, WorkerLink

MODES = ("auto", "ar", "sync", "async")


def drafts_rows_together(drafter: object) -> bool:
    """Whether the worker drafts every row's block of a step in one forward (the cuda backend
    readied ``drafter`` for packed drafting), so that ``sync`` drafts there rather than a row
    at a time in the engine's process (``ModeKit.sync_on_worker``). Where the packed
    drafter's sample at load disagrees, the worker drafts these rows one by one instead
    (:mod:`d3d.worker.packed_check`), answering the same messages."""
    from d3d.backends.cuda.drafter import plan_of

    return plan_of(drafter) is not None


@dataclass
class ModeKit:
    """What a request's proposer is made from. ``link``: the drafter worker (None: none runs);
    ``drafter``: a drafter in this process for ``sync`` (None: ``sync`` drafts on the worker);
    ``max_len``: drafts per block (K); ``read_cost``: the drafter's cost of reading a token
    relative to the target's prefill; ``copies``: a request's copy drafter (None: no copy
    rounds); ``busy``: the drafter's device is reading a document now; ``sync_on_worker``:
    ``sync`` drafts on the worker even with a drafter in this process (module docstring)."""

    host: HostCosts
    vocab_size: int
    max_len: int
    link: WorkerLink | None = None
    drafter: object | None = None
    read_cost: float = 1.0
    copies: Callable[[], CopyDrafts] | None = None
    busy: Callable[[], bool] | None = None
    clock: Clock = WALL
    sync_on_worker: bool = False

    def proposer(self, mode: str, budget: int | None = None, copy: bool = True) -> Proposer:
        """The proposer of ``mode`` for one request (``budget``: its max new tokens; ``copy``:
        ``auto`` may verify copies of the request's own text)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        if mode == "ar":
            return ArProposer()
        spec = self._spec(sync=mode == "sync")
        if mode in ("sync", "async"):
            if spec is None:
                raise DrafterError(f"mode {mode!r} needs a drafter, and none is loaded")
            return spec
        return AutoProposer(
            spec,
            self.host,
            max_len=self.max_len,
            budget=budget,
            read_cost=self.read_cost,
            copies=self.copies() if copy and self.copies is not None else None,
            busy=self.busy,
        )

    def _spec(self, sync: bool) -> Proposer | None:
        here = sync and self.drafter is not None and not self.sync_on_worker
        if self.link is not None and not here:
            return AsyncProposer(
                self.link,
                self.vocab_size,
                clock=self.clock.now,
                branches=not sync,
                max_drafts=self.max_len,
            )
        if self.drafter is not None:
            return SyncProposer(self.drafter, self.clock)
        return None
