"""Per-request proposers for an engine that names its rows and says nothing else.

vLLM calls its proposer once per step, after sampling, with each row's token ids (prompt and
output so far, the tokens just sampled included) and the tokens the step committed for it, and
expects at most K drafts per row back. It does not say when a request starts, finishes, is
preempted or resumes, and it gives no draft probabilities to the verification (its acceptance
without them is exact for any draft: a draft that the target would not have sampled is accepted
with the target's probability of it, and the correction is sampled from the target's
distribution without it).

:class:`RequestRows` turns those calls into the project's own proposer calls, exactly as the own
engine's scheduler makes them: a request's first sight starts its proposer (its tokens but the
last are the prompt, the last is round 0's token), every later step is ``observe(what the step
committed)`` for every row, one flush of the worker's commits, then ``propose`` for every row.
A row is *resynchronised from its token ids* whenever they do not continue what the proposer
last saw (the committed tokens are not the last context plus the step's tokens, or the accepted
part is not a prefix of the drafts handed out: a preemption, a recomputation): its proposer is
closed and started again from the ids. A request missing from a step is closed (a preempted one
comes back as a new start). The modes (``ar``, ``sync``, ``async``, ``auto``) are the project's
proposers, made by the caller's ``make(mode, budget)``; nothing here accepts, prices or drafts.

What the engine's step cost, and what a row's share of it is, comes from the time between two
calls (the engine's schedule, forward and sampling) fitted over the tokens the step verified
(:func:`~d3d.decoding.costs.batch_prices`, the rule the own scheduler prices rows by, over every
row the step decoded, ``ar`` rows included). That time is also what each round observes, by the
rule the worker's branch budget reads in both engines (:func:`~d3d.decoding.rounds.round_seconds`):
the rounds that verified the step's widest block report it, unless the step also read a prompt
(a row still reading, one whose prompt ended in it, or one not seen the step before). It is the
window the worker has for a step's branches: from the blocks it answered in one call to the
commits of the next.

Per request, the rounds are recorded in a :class:`~d3d.decoding.stats.DecodeStats` (vLLM's
metric names, branch hits and misses), kept after the request ends for ``keep_finished``
requests so that the server can ask for them by request id.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from d3d.config import SamplingConfig
from d3d.decoding.costs import LinearCost, batch_prices
from d3d.decoding.proposers import Proposal, Proposer
from d3d.decoding.rounds import round_record, round_seconds
from d3d.decoding.stats import DecodeStats
from d3d.decoding.verify import Acceptance

log = logging.getLogger(__name__)

GREEDY = SamplingConfig()  # drafts are argmax drafts: the verification needs no q (see above)


@dataclass(frozen=True)
class RowView:
    """One row of a step as the engine shows it.

    ``context``: the row's token ids, the step's tokens included; ``sampled``: the tokens the
    step committed (empty: the row is still reading its prompt); ``budget``: new tokens it may
    still produce (None: unknown)."""

    req_id: str
    mode: str
    context: Sequence[int]
    sampled: Sequence[int]
    budget: int | None = None


@dataclass
class _Request:
    proposer: Proposer
    length: int
    stats: DecodeStats
    proposal: Proposal | None = None
    drafts: list[int] = field(default_factory=list)


class RequestRows:
    """The requests of one engine and their proposers (see the module docstring).

    ``make(mode, budget)``: a started-to-be proposer for a request; ``flush()``: send the step's
    commits to the drafter worker (after every row observed); ``max_drafts``: K."""

    def __init__(
        self,
        make: Callable[[str, int | None], Proposer],
        flush: Callable[[], None],
        max_drafts: int,
        clock: Callable[[], float] = time.perf_counter,
        keep_finished: int = 4096,
        totals: DecodeStats | None = None,
    ):
        """``totals``: every round of every request is also recorded there."""
        self.make, self.flush, self.max_drafts, self.clock = make, flush, max_drafts, clock
        self.keep_finished = keep_finished
        self.totals = totals if totals is not None else DecodeStats(mode="all")
        self.live: dict[str, _Request] = {}
        self.finished: OrderedDict[str, dict] = OrderedDict()
        self.cost = LinearCost(window=64)
        self.last_end: float | None = None
        self.last_width = 0  # tokens the last step verified (1 + drafts per decoding row)
        self.last_widest = 0  # the most drafts a row was given for the last step
        self.last_prompts = False  # the step before the last read prompts (some row read on)
        self.last_ids: set[str] = set()  # the rows of the last step
        self.resyncs = 0
        self.reading: dict[str, float] = {}  # rows reading their prompt: when first seen

    # ----- one step ---------------------------------------------------------------------------
    def step(self, rows: Sequence[RowView]) -> list[list[int]]:
        """Every row's drafts for the next step (``[]``: none)."""
        now = self.clock()
        step_s = now - self.last_end if self.last_end is not None else None
        if step_s is not None and self.last_width:
            self.cost.observe(self.last_width, step_s)
        out: list[list[int]] = [[] for _ in rows]
        active: list[tuple[int, RowView, _Request]] = []
        decoding = sum(1 for r in rows if r.sampled)
        prompts = self.last_prompts or any(
            not r.sampled or r.req_id not in self.last_ids for r in rows
        )
        for i, r in enumerate(rows):
            if r.mode == "ar":
                continue
            if not r.sampled:  # a prompt chunk: its reading began at the step before this call
                self.reading.setdefault(r.req_id, self.last_end or now)
                continue
            req = self.live.get(r.req_id)
            if req is not None and self._continues(req, r):
                own_s = round_seconds(len(req.drafts), self.last_widest, prompts, step_s)
                self._observe(req, r, own_s, step_s)
            else:
                if req is not None:
                    self.resyncs += 1
                    log.info("request %s: tokens out of step, proposer resynchronised", r.req_id)
                    self._close(r.req_id, keep=False)
                began = self.reading.pop(r.req_id, None)
                req = self._open(r, now - began if began is not None else step_s)
            req.length = len(r.context)
            active.append((i, r, req))
        self.flush()
        share, token_s = batch_prices(self.cost, decoding)
        for i, r, req in active:
            req.proposer.batch(share, token_s)
            p = req.proposer.propose(list(r.context))
            drafts = p.tokens.tolist()[: self.max_drafts]
            if r.budget is not None:
                drafts = drafts[: max(r.budget - 1, 0)]  # the last token is always the target's
            req.proposal, req.drafts = p, drafts
            out[i] = drafts
        seen = {r.req_id for r in rows}
        for rid in [rid for rid in self.live if rid not in seen]:
            self._close(rid, keep=True)
        for rid in [rid for rid in self.reading if rid not in seen]:
            del self.reading[rid]
        self.last_width = sum(1 + len(d) for d in out if d) + sum(
            1 for (r, d) in zip(rows, out, strict=True) if r.sampled and not d
        )
        self.last_widest = max(map(len, out), default=0)
        self.last_prompts = any(not r.sampled for r in rows)
        self.last_ids = seen
        self.last_end = self.clock()
        return out

    def _continues(self, req: _Request, r: RowView) -> bool:
        n = len(r.sampled)
        if req.length + n != len(r.context) or n - 1 > len(req.drafts):
            return False
        if list(r.sampled[:-1]) != req.drafts[: n - 1]:
            return False
        return list(r.context[req.length :]) == list(r.sampled)

    def _open(self, r: RowView, read_s: float | None) -> _Request:
        """Start a proposer from the row's ids: all but the last are its prompt, the last is
        round 0's token (the prefill's, which took ``read_s``: the steps since the row first
        showed, or the last step; other rows' work in them included, so it errs high)."""
        ctx = list(r.context)
        proposer = self.make(r.mode, r.budget)
        proposer.start(ctx[:-1], GREEDY, None)
        proposer.observe(Acceptance(0, [ctx[-1]]), read_s)
        stats = DecodeStats(mode=r.mode, prompt_tokens=len(ctx) - 1)
        self.live[r.req_id] = req = _Request(proposer, len(ctx), stats)
        return req

    def _observe(self, req: _Request, r: RowView, own_s: float | None, step_s: float | None):
        tokens = list(r.sampled)
        acc = Acceptance(len(tokens) - 1, tokens)
        req.proposer.observe(acc, own_s)
        rnd = round_record(req.proposal, len(req.drafts), acc, tokens, step_s or 0.0)
        for st in (req.stats, self.totals):
            st.num_tokens += len(tokens)
            st.record(rnd)

    def _close(self, rid: str, keep: bool) -> None:
        req = self.live.pop(rid)
        try:
            req.proposer.close()
        except Exception:  # closing must never fail a step
            log.exception("closing the proposer of %s failed", rid)
        if keep:
            self.finished[rid] = req.stats.to_dict()
            while len(self.finished) > self.keep_finished:
                self.finished.popitem(last=False)

    # ----- figures ----------------------------------------------------------------------------
    def stats(self, rid: str) -> dict | None:
        """A request's decode statistics (live or finished), None if never seen."""
        req = self.live.get(rid)
        return req.stats.to_dict() if req is not None else self.finished.get(rid)

    def close(self) -> None:
        for rid in list(self.live):
            self._close(rid, keep=True)
