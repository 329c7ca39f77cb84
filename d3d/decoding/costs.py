"""Measured costs as small online estimators: a moving average, and a line fitted to recent runs.

Every timing that decides something is folded into one of these: :class:`Ema` for a figure
that drifts (a plain step's seconds, tokens per copy round), :class:`LinearCost` for a cost that
grows with a size (a drafter forward over n branches, a prefill chunk of c tokens), fitted as
``t(x) = a + b x`` by least squares over a window of recent samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


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
