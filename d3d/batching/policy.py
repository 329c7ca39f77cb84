"""When a batched step should speculate: a rule over measured costs.

Speculation trades compute for latency. A plain step costs one target forward over B rows x 1
token and yields B tokens. A speculative step costs one forward over B rows x (K+1) tokens plus
one drafter block per speculating row, and yields each speculating row's acceptance length
(1..K+1 tokens). On a GPU at small batch the forward is bound by weight reads, so K+1 tokens cost
about as much as one and speculation wins; as B grows the forward becomes compute-bound, its cost
grows with B x (K+1), and plain steps win. On this CPU a 16-token forward already costs ~2.35x a
1-token one, so speculation pays only above ~3 accepted tokens per round.

The rule, decided before every step from measured numbers only:

    plain rate = tokens(plain) / cost(B x 1)
    spec rate  = tokens(spec)  / (cost(B x (K+1)) + drafts x draft_cost)
    speculate the ``auto`` rows  iff  spec rate > plain rate

where tokens(spec) sums the speculating rows' expected acceptance lengths (their own running
mean once measured, else the engine-wide mean) plus 1 per plain row. Rows that asked for ``ar``
never speculate; rows that asked for an explicit speculative mode always do (so a step with one
of them is a (K+1)-token forward anyway, and the rule prices the ``auto`` rows on that basis).

:class:`CostModel` learns ``cost(x)`` for x = rows x tokens from every timed forward: a running
mean per power-of-two bucket of x, interpolated linearly between measured buckets (and
extrapolated from the last two). Startup calibration (the warm-up generation) measures x = 1
and x = K+1 so the rule has a basis before traffic arrives.

Copy rounds (:mod:`d3d.lookup`): an ``auto`` row that does not draft this step may verify a
copy of its own text instead, which costs no drafter. :func:`choose_copies` prices them on the
same cost model: when the step's forward is already K+1 tokens wide (some row drafts), every
row's copy rides along for free (a copy emits at least the token a plain step would); else the
copies widen the forward, and they go in iff

    (n + sum over copying rows of (tokens per copy round - 1)) / cost(B x (K+1)) > n / cost(B x 1)

with tokens per copy round measured per match-length bucket (:class:`d3d.lookup.CopyCosts`);
a bucket not yet tried ``explore`` times, or declined for ``retry_every`` steps, is priced at an
optimistic prior (4 tokens) instead, so it is tried where trying is cheap (a lone request) and
not where a wide forward costs many plain steps (a large batch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from d3d.lookup import CopyCosts

PLAIN, AUTO, FORCED = "plain", "auto", "forced"


def row_kind(mode: str) -> str:
    """How a request's ``speculative.mode`` enters the rule."""
    if mode == "ar":
        return PLAIN
    if mode == "auto":
        return AUTO
    return FORCED


@dataclass
class RunningMean:
    """Exponentially weighted mean (the first sample sets it)."""

    decay: float = 0.9
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x


@dataclass
class CostModel:
    """Seconds of a target forward as a function of x = rows x tokens; drafter block seconds."""

    buckets: dict[int, RunningMean] = field(default_factory=dict)
    draft: RunningMean = field(default_factory=RunningMean)

    @staticmethod
    def bucket(x: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(1, x))))

    def observe_forward(self, rows: int, tokens: int, seconds: float) -> None:
        b = self.bucket(rows * tokens)
        self.buckets.setdefault(b, RunningMean()).add(seconds)

    def observe_draft(self, seconds: float) -> None:
        self.draft.add(seconds)

    def forward(self, rows: int, tokens: int) -> float | None:
        """Predicted seconds of one forward, or None before any measurement."""
        pts = sorted((b, m.value) for b, m in self.buckets.items() if m.value is not None)
        if not pts:
            return None
        x = self.bucket(rows * tokens)
        if len(pts) == 1:
            b, y = pts[0]
            return y * max(1.0, x / b) if x > b else y
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if x <= x1:
                if x <= x0:
                    return y0
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


@dataclass(frozen=True)
class Plan:
    """The decision for one step: which rows speculate, and the predicted rates behind it."""

    speculate: list[bool]
    plain_rate: float | None = None
    spec_rate: float | None = None


def decide(
    kinds: Sequence[str],
    acceptance: Sequence[float],
    block_size: int,
    costs: CostModel,
    can_draft: bool = True,
) -> Plan:
    """Apply the rule of the module docstring to one step's rows."""
    if not can_draft:
        return Plan([False] * len(kinds))
    forced = [k == FORCED for k in kinds]
    auto = [k == AUTO for k in kinds]
    if not any(auto):
        return Plan(forced)
    n = len(kinds)
    step = costs.forward(n, 1)
    verify = costs.forward(n, block_size)
    draft = costs.draft.value
    if step is None or verify is None or draft is None:
        return Plan(forced)
    n_forced = sum(forced)
    forced_tokens = sum(a for a, f in zip(acceptance, forced, strict=True) if f)
    auto_tokens = sum(a for a, f in zip(acceptance, auto, strict=True) if f)
    others = n - n_forced
    # Option 1: the auto rows take plain steps (inside a (K+1)-token forward if any row is forced).
    plain_rate = (forced_tokens + others) / (verify + n_forced * draft) if n_forced else n / step
    # Option 2: the auto rows speculate too.
    n_spec = n_forced + sum(auto)
    spec_rate = (forced_tokens + auto_tokens + n - n_spec) / (verify + n_spec * draft)
    if spec_rate > plain_rate:
        return Plan([f or a for f, a in zip(forced, auto, strict=True)], plain_rate, spec_rate)
    return Plan(forced, plain_rate, spec_rate)


def choose_copies(
    buckets: Sequence[int | None],
    width: int,
    block_size: int,
    costs: CostModel,
    copy: CopyCosts,
    explore: int = 2,
    retry_every: int = 32,
    prior: float = 4.0,
) -> list[bool]:
    """Which rows verify their copy this step (the rule of the module docstring).

    ``buckets[i]``: the match-length bucket of row i's copy, None when it has none (or drafts
    with the drafter, or asked for ``ar``); ``width``: tokens per row of the step's forward
    without copies (1, or K+1 when a row drafts). A bucket tried fewer than ``explore`` times,
    or declined in ``retry_every`` steps since it was last priced on its own figure, is priced at
    ``prior`` tokens per copy round: exploring stays priced, so a large batch, whose wide
    forward costs many plain steps, does not widen it to learn."""
    rows = [(i, b) for i, b in enumerate(buckets) if b is not None]
    out = [False] * len(buckets)
    if not rows:
        return out
    # On a wide forward a copy costs nothing more than a plain step: every copy goes in.
    if width <= 1:
        n = len(buckets)
        step, wide = costs.forward(n, 1), costs.forward(n, block_size)
        if step is None or wide is None:
            return out
        expect = {}
        for b in {b for _, b in rows}:
            tokens = copy.measured(b, explore)
            expect[b] = prior if tokens is None or copy.skipped[b] >= retry_every else tokens
        gain = sum(max(0.0, expect[b] - 1.0) for _, b in rows)
        take = (n + gain) / wide > n / step
        for b in expect:  # a declined bucket is one step closer to being tried again
            copy.skipped[b] = 0 if take else copy.skipped[b] + 1
        if not take:
            return out
    for i, _ in rows:
        out[i] = True
    return out
