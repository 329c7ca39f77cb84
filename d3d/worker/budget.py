"""How many branches the drafter can afford while the target verifies (an online cost model).

Branch drafting is worth doing only if it ends before the target's verification does; past
that point the target waits and the drafter is back on the critical path. The worker measures
both sides as it runs: the target's verify time (reported with every commit) and its own time
to encode a chain plus draft n branches. It fits ``t(n) = a + b n`` by least squares over recent
rounds (with one distinct n seen so far it assumes the chain costs what one branch costs, a 16-
token forward either way) and picks the largest n with ``t(n) <= safety * t_verify``.

Which rounds report a verify time is one rule for every engine that hosts the worker
(:func:`d3d.decoding.rounds.round_seconds`): a step's forward time goes with the commits of the rounds that verified
its widest block, unless prompts were read in the same forward. The worker takes the longest a
step reports, so in a batch it compares its work with the batched verification it overlaps.

Both sides are wall-clock time. Where the target computes on the drafter's own device (vLLM's CPU
build bound to every core, the drafter's included), branch work can only run when the verify
lets go of that core, so it measures about a verify, and the budget rightly drafts no branch:
nothing hides behind a verification that holds the drafter's device.
"""

from __future__ import annotations

from d3d.decoding.costs import Ema, LinearCost


class BranchBudget:
    """Chooses the number of branches per round from measured costs (see the module docstring)."""

    def __init__(
        self, max_branches: int = 16, safety: float = 0.85, start: int = 4, window: int = 48
    ):
        self.max_branches = max_branches
        self.safety = safety
        self.start = min(start, max_branches)
        self.verify = Ema()
        self.cost = LinearCost(window)

    def observe_verify(self, seconds: float) -> None:
        if seconds > 0:
            self.verify.add(seconds)

    def observe_cost(self, n: int, seconds: float) -> None:
        self.cost.observe(n, seconds)

    def cost_model(self) -> tuple[float, float] | None:
        """(a, b) of t(n) = a + b n for one row, or None before any measurement."""
        return self.cost.fit()

    def choose(self, rows: int = 1) -> int:
        """Branches per row when ``rows`` rows share the verify: their chains and branches,
        drafted one row after another, must all end before the batched verify does."""
        model = self.cost_model()
        if model is None or self.verify.value is None:
            return self.start
        a, b = model
        n = int((self.safety * self.verify.value - rows * a) // (b * rows))
        return max(0, min(self.max_branches, n))

    def summary(self) -> dict:
        model = self.cost_model()
        return {
            "verify_ms": None if self.verify.value is None else round(self.verify.value * 1e3, 2),
            "chain_ms": None if model is None else round(model[0] * 1e3, 2),
            "per_branch_ms": None if model is None else round(model[1] * 1e3, 2),
            "branches": self.choose(),
        }
