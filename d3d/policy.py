"""``auto``: speculation only where it pays, decided per request from measured costs.

Speculation is a bet: a round costs a verify forward (plus any drafting left on the critical
path) and yields the acceptance length's worth of tokens; a plain step costs one decode step and
yields one. :class:`SpeculationPolicy` keeps both sides' measured figures and, before every
round, compares the rates:

    speculate  iff  AL / t_round  >  (1 + margin) / t_step

- ``t_step`` and ``t_round`` are moving averages of measured round times (``t_round`` includes
  the wait for the drafter, so misses and a slow drafter count against speculation). They are
  host costs, kept in a :class:`HostCosts` that the engine shares across requests.
- ``AL`` (tokens per speculative round) is this request's own moving average, started from the
  host's; acceptance depends on the text, so it is learned per request.
- Each quantity is measured before it is trusted: a request first takes one plain step when the
  host has no step time, and speculates for a warm-up of rounds when it has no round figures.
- While off, it *probes*: after ``probe_every`` plain tokens it runs ``probe_rounds``
  speculative rounds to refresh AL and t_round; each probe that still loses doubles the interval
  (up to ``max_probe_every``), a winning one switches speculation back on. The first round of a
  probe usually misses the asynchronous branches (the worker had no chain to branch from), so
  the first round of every run of speculative rounds never updates ``t_round``.

With the host's figures showing speculation losing, a request starts with speculation off; the
cost of being wrong is bounded by the probes, a few rounds per few hundred tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from d3d.config import SamplingConfig
from d3d.decode import NO_DRAFT, Proposal, Proposer
from d3d.pipeline.budget import Ema
from d3d.verify import Acceptance


@dataclass
class HostCosts:
    """Measured costs of this host, shared by the requests of one engine."""

    step_s: Ema = field(default_factory=lambda: Ema(0.1))
    round_s: Ema = field(default_factory=lambda: Ema(0.1))
    accept: Ema = field(default_factory=lambda: Ema(0.05))


@dataclass
class SpeculationPolicy:
    """Per-request decision rule (see the module docstring)."""

    host: HostCosts
    margin: float = 0.03
    warmup_rounds: int = 3
    probe_every: int = 16
    max_probe_every: int = 512
    probe_rounds: int = 2
    accept: Ema = field(default_factory=lambda: Ema(0.25))
    on: bool = True
    probe_left: int = 0
    since_probe: int = 0
    interval: int = 0
    spec_rounds: int = 0

    def __post_init__(self) -> None:
        self.accept.value = self.host.accept.value
        self.interval = self.probe_every
        self.on = self._pays() if self._known() else True

    def _known(self) -> bool:
        return None not in (self.host.step_s.value, self.host.round_s.value, self.accept.value)

    def _pays(self) -> bool:
        step, rnd, al = self.host.step_s.value, self.host.round_s.value, self.accept.value
        return al / rnd > (1.0 + self.margin) / step

    def speculate(self) -> bool:
        """Should the next round speculate?"""
        if self.host.step_s.value is None:
            return False  # measure a plain step first (one token)
        if self.probe_left > 0 or not self._known():
            return True
        return self.on

    def record(self, speculative: bool, tokens: int, seconds: float, first_of_run: bool) -> None:
        """A finished round: ``tokens`` emitted in ``seconds``; ``first_of_run``: the first
        speculative round after plain ones (its time includes a cold draft)."""
        if not speculative:
            self.host.step_s.add(seconds / max(tokens, 1))
            if not self.on:
                self.since_probe += tokens
                if self.since_probe >= self.interval:
                    self.probe_left, self.since_probe = self.probe_rounds, 0
            return
        self.accept.add(tokens)
        self.host.accept.add(tokens)
        if not first_of_run:
            self.host.round_s.add(seconds)
        if self.probe_left > 0:
            self.probe_left -= 1
            if self.probe_left == 0:  # the probe is over: judge it
                self.on = self._pays()
                self.interval = (
                    self.probe_every if self.on else min(2 * self.interval, self.max_probe_every)
                )
            return
        self.spec_rounds += 1
        if self.spec_rounds >= self.warmup_rounds and self._known():
            self.on = self._pays()


class AutoProposer:
    """Speculates through ``spec`` (async or sync) when the policy says it pays, else proposes
    nothing (a plain target step). The split of tokens is in the stats (spec/ar tokens)."""

    name = "auto"

    def __init__(self, spec: Proposer, host: HostCosts):
        self.spec = spec
        self.host = host

    def start(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        draft_prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.policy = SpeculationPolicy(self.host)
        self.spec.start(prompt_ids, sampling, generator, draft_prompt_ids)
        self.current: Proposal | None = None
        self.next_spec = self.policy.speculate()
        self.prev_spec = False

    def propose(self, tokens: list[int]) -> Proposal:
        self.current = self.spec.propose(tokens) if self.next_spec else NO_DRAFT
        return self.current

    def observe(self, acc: Acceptance, verify_s: float, want_next: bool = True) -> None:
        if self.current is not None:  # round 0 (the prefill) has no proposal
            spec = self.current.k > 0
            self.policy.record(
                spec, len(acc.tokens), self.current.wait_s + verify_s, spec and not self.prev_spec
            )
            self.prev_spec = spec
        self.next_spec = want_next and self.policy.speculate()
        self.spec.observe(acc, verify_s, want_next=self.next_spec)

    def close(self) -> None:
        self.spec.close()
