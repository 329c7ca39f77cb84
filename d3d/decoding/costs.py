"""Measured costs and acceptance as small online estimators.

Every timing that decides something is folded into one of these: :class:`Ema` for a figure
that drifts (a plain step's seconds, the verify's cost per token), :class:`LinearCost` for a
cost that grows with a size (a drafter forward over n branches, a prefill chunk of c tokens),
fitted as ``t(x) = a + b x`` by least squares over a window of recent samples. What a draft
yields is :class:`PositionStats`, conditional acceptance per draft position with forgetting,
turned into tokens per round by :func:`expected_tokens`; ``auto``'s drafter rounds and its
copy rounds (:mod:`d3d.decoding.lookup`) both choose their length n among ``LENGTHS`` by
tokens per second, ``E(n) / (t_step + c n)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Ema:
    """Exponential moving average; ``value`` is None until the first observation."""

    alpha: float = 0.2
    value: float | None = None

    def add(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        return self.value


class LinearCost:
    """``t(x) = a + b x`` over the last ``window`` samples (x: a size, t: seconds).

    With one distinct x so far (or a fit whose slope is not positive) it assumes the fixed part
    costs what one unit costs, ``a = b = mean t / (1 + mean x)``: a forward over one more unit
    costs about what the smallest forward does, on this CPU and on a GPU alike.
    """

    def __init__(self, window: int = 48):
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, x: float, seconds: float) -> None:
        self.samples.append((float(x), seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before any sample."""
        if not self.samples:
            return None
        xs = [x for x, _ in self.samples]
        ts = [t for _, t in self.samples]
        mean_x, mean_t = sum(xs) / len(xs), sum(ts) / len(ts)
        var = sum((x - mean_x) ** 2 for x in xs)
        if var > 0:
            b = sum((x - mean_x) * (t - mean_t) for x, t in self.samples) / var
            if b > 0:
                return max(mean_t - b * mean_x, 0.0), b
        unit = mean_t / (1 + mean_x)
        return unit, unit


def batch_prices(cost: LinearCost, rows: int) -> tuple[float | None, float | None]:
    """What a decoding row's plain token costs among ``rows`` rows sharing one forward (the
    step ``a + b rows`` over the rows), and what one more token of that forward costs (``b``),
    from the forwards' fit ``cost``; (None, None) for a row alone (it is priced with the host's
    plain step) or before any forward was timed. Every engine that batches rows prices them so."""
    fit = cost.fit() if rows > 1 else None
    if fit is None:
        return None, None
    a, b = fit
    return (a + b * rows) / rows, b


LENGTHS = (1, 2, 3, 4, 6, 8, 11, 15)  # draft lengths auto chooses among


@dataclass
class PositionStats:
    """Conditional acceptance per draft position, with exponential forgetting."""

    decay: float = 0.97
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def update(self, drafted: int, num_accepted: int) -> None:
        need = max(drafted, len(self.reached))
        self.reached += [0.0] * (need - len(self.reached))
        self.accepted += [0.0] * (need - len(self.accepted))
        # Positions 1..n+1 were tried; only they forget, so what is known of positions beyond
        # the drafts in use stays until a longer draft measures them again.
        for i in range(min(num_accepted + 1, drafted)):
            self.reached[i] = self.reached[i] * self.decay + 1.0
            self.accepted[i] = self.accepted[i] * self.decay + float(i < num_accepted)

    def rates(
        self,
        n: int,
        prior: PositionStats | None = None,
        strength: float = 2.0,
        first: float = 0.5,
    ) -> list[float]:
        """a_1..a_n, each shrunk towards ``prior``'s, or without one towards the position
        before it (conditional acceptance changes slowly along a block; ``first`` for the
        first)."""
        out: list[float] = []
        base_rates = prior.rates(n) if prior is not None else None
        for i in range(n):
            base = base_rates[i] if base_rates is not None else (out[-1] if out else first)
            r = self.reached[i] if i < len(self.reached) else 0.0
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            out.append((a + strength * base) / (r + strength))
        return out

    @property
    def observed(self) -> bool:
        return bool(self.reached) and self.reached[0] > 0


def expected_tokens(rates: Sequence[float]) -> float:
    """E(n) = 1 + sum_j prod_{i<=j} a_i: tokens per round when n = len(rates) drafts are verified."""
    total, run = 1.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total
