"""``auto``: speculation only where it pays, and only as far ahead as pays, from measured costs.

A speculative round that verifies n drafts costs one target forward over n + 1 tokens plus any
drafting left on the critical path, and yields ``E(n) = 1 + sum_{j<=n} prod_{i<=j} a_i`` tokens
on average, where ``a_i`` is the chance that draft i is accepted once drafts 1..i-1 were. A plain
step costs one decode step and yields one token. :class:`SpeculationPolicy` keeps the measured
figures and, before every round, picks

    n* = argmax_n E(n) / t_round(n),   t_round(n) = t_step + c n + t_wait

and speculates (verifying the first n* drafts of the block) iff ``E(n*) / t_round(n*) >
(1 + margin) / t_step``; otherwise it takes a plain step.

- ``t_step`` (plain step), ``c`` (the verify forward's cost per extra token, from measured
  verify times: ``(t_verify - t_step) / n``) and ``t_wait`` (drafting left on the critical path
  per round: all of it for ``sync``, misses for ``async``) are host costs, moving averages kept
  in a :class:`HostCosts` that the engine shares across requests.
- ``a_i`` are counts of (reached, accepted) per draft position with exponential forgetting:
  this request's own, shrunk towards the host's (acceptance depends on the text).
- In a batch a plain token costs the row only its share of the step (the scheduler's fitted
  forward cost over its rows, :meth:`AutoProposer.batch`), while every verified token widens the
  one forward all rows share: a round there must beat that share, ``t_step`` replaced by it in
  both sides of the rule (copy rounds too), and a batched step's time teaches the host nothing.
- Verifying fewer drafts is the lever on a host where the verify forward is expensive (this
  CPU): a drafter of modest acceptance can pay at a few drafts and lose at the whole block
  (measured: docs/results.md, "Figures from the code's docstrings").
- Each figure is measured before it is trusted: a request takes one plain step when the host has
  no step time, and speculates with the whole block while it lacks round figures.
- While off it *probes*: after ``probe_every`` plain tokens it runs ``probe_rounds`` speculative
  rounds at the best length; a winning probe switches speculation back on, and each probe that
  still loses at least doubles the interval, and stretches it until what the probe cost beyond
  plain steps (a cold drafter catching up on the text, blocks, verifies) is ``probe_share`` of
  the plain decoding between probes, up to ``max_probe_every``. The interval and the count
  since the last probe are the host's, so probes are paced over all requests' tokens. Acceptance counts forget
  only at the positions a round tried, so what was measured beyond the length in use stays;
  every ``explore_every``-th speculative round tries the next longer length to keep measuring.
  On a fresh host :mod:`d3d.engine.calibration` seeds the figures at load and paces the first probe
  with :meth:`SpeculationPolicy.pace` (a probe estimated, the drafter's re-reading included).
  The first round of every run of speculative rounds waits for a cold draft (the asynchronous
  worker had no chain to branch from), so its wait updates ``t_wait`` only while nothing else is
  known (an overstatement, which errs towards plain steps).
- A drafter that sat out plain steps must first read what it missed (the whole prompt, on a
  request's first speculative round). :class:`AutoProposer` prices that catch-up at the
  target's measured prefill cost per token and starts no speculative run (a probe, or the
  host's first measurement) whose catch-up alone exceeds ``max_saving`` (one half) of the plain
  decoding the request's remaining tokens would take: even speculation that halved the rest
  could not pay it back. The remaining tokens are what the budget leaves, but no more than the
  host's typical answer (a moving average of its requests' lengths) still leaves, or than the
  request has produced so far when that is more (a request as long as its past is expected to
  go on as long again; with no past, a fresh process). A short answer after a long prompt
  (document QA) then never speculates, whatever its budget, and a deferred probe waits for a
  request with room for it. The prefill's cost per token is read with a cached prompt prefix
  priced like the rest (the decode loop reports round 0 that way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from d3d.config import SamplingConfig
from d3d.decoding.costs import LENGTHS, Ema, PositionStats, expected_tokens
from d3d.decoding.lookup import CopyCosts, CopyDraft, CopyDrafts
from d3d.decoding.proposers import NO_DRAFT, Proposal, Proposer
from d3d.decoding.verify import Acceptance


@dataclass
class HostCosts:
    """Measured costs of this host, shared by the requests of one engine."""

    step_s: Ema = field(default_factory=lambda: Ema(0.1))
    per_token_s: Ema = field(default_factory=lambda: Ema(0.1))
    wait_s: Ema = field(default_factory=lambda: Ema(0.1))
    accept: PositionStats = field(default_factory=lambda: PositionStats(decay=0.99))
    # Probing is paced over the host's traffic, not per request: while speculation keeps
    # losing, the interval keeps growing across requests instead of restarting at each one.
    probe_interval: int = 0
    since_probe: int = 0
    wait_from_cold: bool = False  # t_wait so far comes from a cold first round only
    read_s: Ema = field(default_factory=lambda: Ema(0.2))  # target prefill s per prompt token
    answer_len: Ema = field(default_factory=lambda: Ema(0.2))  # tokens per finished request
    copy: CopyCosts = field(default_factory=CopyCosts)  # copy rounds (d3d.decoding.lookup)


@dataclass
class SpeculationPolicy:
    """Per-request decision rule (see the module docstring)."""

    host: HostCosts
    max_len: int = 15
    margin: float = 0.03
    probe_every: int = 16
    max_probe_every: int = 2048
    probe_rounds: int = 2
    probe_share: float = 0.01
    explore_every: int = 16
    accept: PositionStats = field(default_factory=PositionStats)
    on: bool = True
    best: int = 15
    probe_left: int = 0
    probe_spent: float = 0.0  # seconds and tokens of the probe under way
    probe_tokens: int = 0
    spec_rounds: int = 0

    def __post_init__(self) -> None:
        if self.host.probe_interval <= 0:
            self.host.probe_interval = self.probe_every
        self.best = self.max_len
        if self._known():
            self._decide()

    def _known(self) -> bool:
        h = self.host
        return (
            None not in (h.step_s.value, h.per_token_s.value, h.wait_s.value) and h.accept.observed
        )

    def rate(self, n: int, step_s: float | None = None) -> float:
        """Expected tokens per second when verifying n drafts (``step_s``: what a plain token
        costs, when not the host's plain step: the row's share of a batched step)."""
        h = self.host
        step = h.step_s.value if step_s is None else step_s
        a = self.accept.rates(n, prior=h.accept)
        return expected_tokens(a) / (step + h.per_token_s.value * n + h.wait_s.value)

    def pays_at(self, n: int, step_s: float) -> bool:
        """Whether verifying n drafts beats plain tokens that cost ``step_s`` each (True while
        the figures are not known: they are measured first)."""
        if not self._known():
            return True
        return self.rate(n, step_s) > (1.0 + self.margin) / step_s

    def _decide(self) -> None:
        lengths = [n for n in LENGTHS if n < self.max_len] + [self.max_len]
        self.best = max(lengths, key=self.rate)
        self.on = self.pays_at(self.best, self.host.step_s.value)

    def next_len(self) -> int:
        """Drafts to verify in the next round: 0 for a plain step."""
        if self.host.step_s.value is None:
            return 0  # measure a plain step first (one token)
        if not self._known():
            return self.max_len
        if self.on and self.spec_rounds % self.explore_every == self.explore_every - 1:
            longer = [n for n in LENGTHS if self.best < n < self.max_len] + [self.max_len]
            return longer[0]  # now and then one length further, to keep measuring it
        return self.best if self.on or self.probe_left > 0 else 0

    def record(
        self,
        drafted: int,
        num_accepted: int,
        tokens: int,
        verify_s: float | None,
        wait_s: float,
        first_of_run: bool,
    ) -> None:
        """A finished round: ``drafted`` drafts verified (0: a plain step), ``tokens`` emitted;
        its target time (None: it shared a forward, not its own cost) and the wait for
        its draft; ``first_of_run``: the first speculative round after plain ones."""
        h = self.host
        if drafted == 0:
            if verify_s is not None:
                h.step_s.add(verify_s / max(tokens, 1))
            self.count_plain(tokens)
            return
        self.spec_rounds += 1
        measuring = not self._known()  # the host's first rounds: a probe of their own
        self.accept.update(drafted, num_accepted)
        h.accept.update(drafted, num_accepted)
        if h.step_s.value is not None and verify_s is not None:
            h.per_token_s.add(max(verify_s - h.step_s.value, 0.0) / drafted)
        if h.wait_s.value is None or (h.wait_from_cold and not first_of_run):
            # A cold first round overstates the wait: it stands in only until a warm round
            # replaces it, which errs on the side of plain steps meanwhile.
            h.wait_s.value, h.wait_from_cold = wait_s, first_of_run
        elif not first_of_run:
            h.wait_s.add(wait_s)
        if measuring or self.probe_left > 0:  # what the next probe interval answers for
            self.probe_spent += (verify_s or 0.0) + wait_s
            self.probe_tokens += tokens
        if self.probe_left > 0:
            self.probe_left -= 1
            if self.probe_left == 0 and self._known():  # the probe is over: judge it
                self._decide()
                h.probe_interval = self.probe_every if self.on else self._next_interval()
            return
        if self._known():
            self._decide()
            if measuring and not self.on and not h.wait_from_cold:
                h.probe_interval, h.since_probe = self._next_interval(), 0

    def copy_timed(self, drafted: int, verify_s: float | None) -> None:
        """A copy round of ``drafted`` tokens timed alone: the verify's cost per token, while
        nothing else has measured it (a host that skipped calibration and has no drafter)."""
        h = self.host
        if h.per_token_s.value is None and None not in (verify_s, h.step_s.value):
            h.per_token_s.add(max(verify_s - h.step_s.value, 0.0) / max(drafted, 1))

    def count_plain(self, tokens: int) -> None:
        """Tokens committed without the drafter (plain steps, copy rounds): they bring the
        next probe closer while speculation is off."""
        h = self.host
        if not self.on:
            h.since_probe += tokens
            if h.since_probe >= h.probe_interval:
                self.probe_left, h.since_probe = self.probe_rounds, 0
                self.probe_spent, self.probe_tokens = 0.0, 0

    def pace(self, catch_up_s: float = 0.0) -> int:
        """The probe interval after a losing probe of ``probe_rounds`` rounds at the best length,
        estimated from the current figures instead of run (:mod:`d3d.engine.calibration`).

        ``catch_up_s``: the drafter's cost of re-reading one skipped token (a probe after N
        plain tokens first reads them). The interval is the N at which the probe's excess over
        plain steps, its re-reading included, is ``probe_share`` of N plain steps; where the
        re-reading alone costs more than that share, ``max_probe_every``."""
        h = self.host
        step, per_token = h.step_s.value, h.per_token_s.value
        assert step is not None and per_token is not None
        n = self.best
        spent = self.probe_rounds * (step + per_token * n + (h.wait_s.value or 0.0))
        tokens = self.probe_rounds * expected_tokens(self.accept.rates(n, prior=h.accept))
        excess = max(spent - tokens * step, 0.0)
        room = self.probe_share * step - catch_up_s
        if room <= 0:
            return self.max_probe_every
        return min(max(2 * h.probe_interval, int(excess / room)), self.max_probe_every)

    def _next_interval(self) -> int:
        """Plain tokens until the next probe after a losing one (see the module docstring)."""
        step = self.host.step_s.value
        excess = self.probe_spent - self.probe_tokens * step
        pays_off = int(excess / (self.probe_share * step)) if excess > 0 else 0
        return min(max(2 * self.host.probe_interval, pays_off), self.max_probe_every)


class AutoProposer:
    """Speculates through ``spec`` (async or sync) as far as the policy says pays; in the rounds
    it does not, verifies a copy from the request's own text where one pays (``copies``,
    :mod:`d3d.decoding.lookup`), else proposes nothing (a plain target step). Without a ``spec`` (no
    drafter) it only ever copies or steps. The split of tokens is in the stats (spec/ar tokens,
    copy rounds)."""

    name = "auto"

    def __init__(
        self,
        spec: Proposer | None,
        host: HostCosts,
        max_len: int = 15,
        budget: int | None = None,
        read_cost: float = 1.0,
        max_saving: float = 0.5,
        copies: CopyDrafts | None = None,
        busy: Callable[[], bool] | None = None,
    ):
        """``budget``: the request's token budget (None: unbounded, no catch-up check);
        ``read_cost``: the drafter's cost of reading a token relative to the target's prefill
        (its depth over the target's); ``max_saving``: see the module docstring; ``busy``: true
        while the drafter's device does other work (reading a document for compression): no
        speculative run starts then, since its blocks would wait for that work."""
        self.spec = spec
        self.host = host
        self.max_len = max_len
        self.budget = budget
        self.read_cost = read_cost
        self.max_saving = max_saving
        self.copies = copies
        self.busy = busy or (lambda: False)
        self.copy: CopyDraft | None = None  # the copy verified this round, if any
        self.share_s: float | None = None  # this row's share of a batched step (None: alone)
        self.token_s: float | None = None  # a batched forward's cost per token

    def start(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        draft_prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.policy = SpeculationPolicy(self.host, max_len=self.max_len)
        self.greedy = sampling.greedy
        self.produced = 0
        self.target_len = len(prompt_ids)
        self.prompt_len = len(draft_prompt_ids if draft_prompt_ids is not None else prompt_ids)
        self.unread = self.prompt_len  # what the drafter has to read before its first block
        self.next_len = self.policy.next_len() if self.spec is not None and not self.busy() else 0
        if self.next_len > 0 and not self._catch_up_pays():
            self.next_len = 0
        if self.next_len > 0:
            self.unread = 0
        if self.spec is not None:
            self.spec.start(
                prompt_ids, sampling, generator, draft_prompt_ids, first_len=self.next_len
            )
        self.current: Proposal | None = None
        self.prev_spec = False

    def batch(self, share_s: float | None, token_s: float | None = None) -> None:
        """What this row's plain token costs in the step about to run when other rows share it
        (the batched step's time over its rows; None: alone), and what one more token of the
        step's forward costs (``token_s``, used while the host has no verify cost per token). A
        copy or a speculative round adds its verified tokens to the whole batch's forward, so
        in a batch it must beat that share, not a plain step alone: on a CPU, where a batched
        step costs ~1 ms more a row, a copy that pays alone loses among 16 rows."""
        self.share_s, self.token_s = share_s, token_s

    def _plain_s(self) -> float | None:
        """What a plain token of this row costs now."""
        return self.share_s if self.share_s is not None else self.host.step_s.value

    def propose(self, tokens: list[int]) -> Proposal:
        self.copy = None
        if self.next_len and self.spec is not None:
            self.current = self.spec.propose(tokens)
        elif self.copies is not None and (
            copy := self.copies.propose(
                tokens, self._plain_s(), self.host.per_token_s.value or self.token_s, self.greedy
            )
        ):
            self.copy = copy
            self.current = Proposal(copy.tokens, copy.q, source="copy")
        else:
            self.current = NO_DRAFT
        return self.current

    @property
    def speculating(self) -> bool:
        return self.next_len > 0 and self.spec is not None and self.spec.speculating

    @property
    def failed(self) -> bool:
        """Its speculating proposer's worker failed (auto then decodes plainly to the end)."""
        return self.spec is not None and self.spec.failed

    def observe(self, acc: Acceptance, verify_s: float | None, next_len: int | None = None) -> None:
        cur = self.current
        self.produced += len(acc.tokens)
        own_s = verify_s if self.share_s is None else None  # a batch's time is no row's step
        if cur is None and verify_s is not None:  # round 0: the prefill (of the target's prompt)
            self.host.read_s.add(verify_s / max(self.target_len, 1))
        if self.copy is not None:  # a copy round: the drafter's figures are not its business
            assert self.copies is not None
            self.copies.record(self.copy, acc.num_accepted)
            self.policy.copy_timed(self.copy.tokens.numel(), own_s)
            self.policy.count_plain(len(acc.tokens))
            self.prev_spec = False
        elif cur is not None:  # round 0 (the prefill) has no proposal
            spec = cur.k > 0
            self.policy.record(
                cur.k,
                acc.num_accepted,
                len(acc.tokens),
                own_s,
                cur.wait_s,
                spec and not self.prev_spec,
            )
            self.prev_spec = spec
        was = self.next_len > 0
        # A worker that failed serves this request no more: plain steps to the end.
        off = next_len == 0 or self.spec is None or self.spec.failed
        self.next_len = 0 if off else self.policy.next_len()
        share = self.share_s
        if self.next_len and share is not None and not self.policy.pays_at(self.next_len, share):
            self.next_len = 0  # it pays alone, not among the rows sharing the step
        if self.next_len > 0 and not was and self.busy():
            self.next_len = 0  # a run starts only while the drafter's device is free
        if self.next_len > 0 and not was and not self._catch_up_pays():
            self.next_len = 0
        if self.next_len == 0:
            self.unread += len(acc.tokens)
        else:
            self.unread = 0
        if self.spec is not None:
            self.spec.observe(acc, verify_s, next_len=self.next_len)

    def _catch_up_pays(self) -> bool:
        """Whether the drafter's catch-up (what it has not read) could pay for itself within
        the tokens left (see the module docstring)."""
        step, read = self.host.step_s.value, self.host.read_s.value
        if self.budget is None or read is None or step is None:
            return True
        return self.unread * self.read_cost * read <= self.max_saving * self.expected_left() * step

    def expected_left(self) -> int:
        """Tokens this request is expected still to produce (see the module docstring)."""
        assert self.budget is not None
        typical = self.host.answer_len.value or 0.0
        return min(self.budget - self.produced, max(self.produced, int(typical) - self.produced))

    def close(self) -> None:
        if self.produced > 0:
            self.host.answer_len.add(self.produced)
        if self.spec is not None:
            self.spec.close()
