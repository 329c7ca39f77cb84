"""Seeding ``auto``'s host costs before the first request: a short calibration at load and the
acceptance the drafter ships with.

A fresh process knows nothing of its host, so ``auto`` measured on the first request's own time:
a plain step, speculative rounds until the drafter's figures were known, then probes every 16
plain tokens, doubling while they lose. On this CPU that cost a large share of a short answer's
time, enough to make the first ``make demo`` on a machine slower than the target alone
(measured: docs/results.md, "Figures from the code's docstrings"). :func:`seed` replaces that:

- :func:`calibrate` times, on a short synthetic context, the target's plain step and its verify
  of a whole block, and one drafter block, a few times each (well under a second at load), and
  enters the medians into the host's moving averages like measured rounds. The drafter's block
  becomes the wait, as a cold first round's would (``wait_from_cold``): for ``async``, whose
  drafting hides behind the verify when its branch hits, an overstatement that errs towards
  plain steps and is replaced by the first warm round.
- :func:`acceptance_prior` turns the acceptance a checkpoint ships (``meta.notes["acceptance"]``:
  the share of rounds accepting at least k drafts, measured offline on held-out prompts with
  ``d3d accept``) into position counts worth a few rounds, so that real rounds soon outweigh it.
- With both, the policy decides at the first token. Where speculation loses, the first probe is
  paced as if a probe had just been measured at these figures, its drafter's catch-up included
  (:meth:`d3d.decoding.policy.SpeculationPolicy.pace`): a drafter that re-reads every skipped
  token at a cost above 1 % of a plain step per token (the shipped one, as deep as the target,
  costs more; measured: docs/results.md, "Figures from the code's docstrings") can never pay a
  probe back, and is probed only every 2,048 tokens.

Costs stored by an earlier process on this host (:mod:`d3d.engine.cost_memory`) win: :func:`seed` does
nothing once the host has a plain step's time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from d3d.backends import Backend, for_model
from d3d.backends.clock import WALL, Clock
from d3d.config import SamplingConfig
from d3d.decoding.policy import HostCosts, PositionStats, SpeculationPolicy
from d3d.decoding.proposers import Drafter

PRIOR_ROUNDS = 8.0  # how many measured rounds a shipped acceptance counts as
CONTEXT = 64  # tokens of synthetic context the calibration runs on
REPEATS = 3


def acceptance_prior(shares: Sequence[float], rounds: float = PRIOR_ROUNDS) -> PositionStats:
    """Counts per draft position from the share of rounds accepting >= k drafts (k = 1..K):
    position k is reached by ``share[k-1]`` of the rounds and accepted by ``share[k]``."""
    reached, accepted, before = [], [], 1.0
    for share in shares:
        share = min(max(float(share), 0.0), before)
        reached.append(rounds * before)
        accepted.append(rounds * share)
        before = share
        if before <= 0.0:
            break
    return PositionStats(decay=0.99, reached=reached, accepted=accepted)


def shipped_acceptance(drafter) -> list[float] | None:
    """The per-position acceptance shares a drafter's checkpoint carries, if any."""
    notes = getattr(getattr(drafter, "meta", None), "notes", None) or {}
    shares = (notes.get("acceptance") or {}).get("per_position")
    return [float(x) for x in shares] if shares else None


def median_seconds(fn, clock: Clock, repeats: int = REPEATS) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` on ``clock`` (device-synchronised)."""
    times = []
    for _ in range(repeats):
        t0 = clock.now()
        fn()
        times.append(clock.now() - t0)
    return statistics.median(times)


@torch.inference_mode()
def calibrate(
    host: HostCosts,
    model,
    drafter: Drafter | None,
    block_size: int,
    on_switch: Callable[[bool], None] | None = None,
    clock: Clock = WALL,
    backend: Backend | None = None,
) -> dict:
    """Time a plain step, a block verify and a drafter block; enter them into ``host``.

    Returns the figures (seconds). The context is synthetic: token ids only shape the timing.
    ``on_switch(speculating)`` gives the target the cores it has in plain or in speculative
    rounds (:meth:`d3d.engine.Engine.cpu_budget`): the step is timed as plain rounds run, the
    verify and the drafter's block as speculative rounds do."""
    switch = on_switch or (lambda _speculating: None)
    vocab = model.get_input_embeddings().num_embeddings
    ctx = [(100 + i) % vocab for i in range(CONTEXT)]
    # The engine's own forward (a batch of one), with a KV budget of its own.
    target = (backend or for_model(model)).target(
        model, CONTEXT + 2 * block_size, clock, rows=1, block=block_size
    )
    row = target.kv.open(CONTEXT + block_size)
    switch(False)
    t0 = clock.now()
    target.forward([row], [ctx], [[CONTEXT - 1]])
    read = (clock.now() - t0) / len(ctx)
    target.kv.commit(row, CONTEXT)

    def forward(n: int) -> None:  # verified and rolled back: nothing is committed
        target.forward([row], [ctx[-n:]])

    forward(1)  # the first decode-shaped forward builds its kernels
    step = median_seconds(lambda: forward(1), clock)
    switch(True)
    forward(block_size)
    verify = median_seconds(lambda: forward(block_size), clock)
    host.step_s.add(step)
    host.per_token_s.add(max(verify - step, 0.0) / (block_size - 1))
    if host.read_s.value is None:
        host.read_s.add(read)
    out = {"step_s": step, "verify_s": verify, "read_s": read}
    if drafter is not None:
        drafts = drafter.session(SamplingConfig(), None)
        drafts.draft(ctx)  # reads the context (the drafter's prefill)
        grown = list(ctx)

        def block() -> None:
            grown.append(grown[-1])
            drafts.draft(grown)

        block()
        out["draft_s"] = median_seconds(block, clock)
        host.wait_s.value, host.wait_from_cold = out["draft_s"], True
    switch(False)
    return out


def seed(
    host: HostCosts,
    model,
    drafter: Drafter | None,
    block_size: int,
    read_cost: float = 1.0,
    on_switch: Callable[[bool], None] | None = None,
    clock: Clock = WALL,
    backend: Backend | None = None,
) -> dict | None:
    """Calibrate a fresh host, take the drafter's shipped acceptance, pace the first probe.

    ``read_cost``: the drafter's cost of reading a token relative to the target's prefill (a
    probe first re-reads what the drafter skipped). Does nothing (returns None) when the host
    already has a plain step's time."""
    if host.step_s.value is not None:
        return None
    figures = calibrate(host, model, drafter, block_size, on_switch, clock, backend)
    shares = shipped_acceptance(drafter) if drafter is not None else None
    if shares and not host.accept.observed:
        host.accept = acceptance_prior(shares[: block_size - 1])
    if drafter is not None and host.accept.observed:
        policy = SpeculationPolicy(host, max_len=block_size - 1)
        figures["speculate"] = policy.on
        if not policy.on:
            host.probe_interval = policy.pace(read_cost * (host.read_s.value or 0.0))
        figures["probe_interval"] = host.probe_interval
    return figures
