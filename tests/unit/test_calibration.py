"""Seeding auto's host costs: the shipped acceptance as position counts, the calibration's
figures, the first probe paced from them, stored costs left alone."""

from __future__ import annotations

import pytest

from d3d.decoding.costs import Ema
from d3d.decoding.policy import HostCosts, SpeculationPolicy, expected_tokens
from d3d.engine.calibration import acceptance_prior, seed, shipped_acceptance
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model


def test_acceptance_shares_become_position_counts():
    prior = acceptance_prior([0.6, 0.3, 0.1], rounds=10)
    assert prior.reached == pytest.approx([10.0, 6.0, 3.0])
    assert prior.accepted == pytest.approx([6.0, 3.0, 1.0])
    # conditional rates 0.6, 0.5, 1/3, pulled a little towards the previous position
    a = prior.rates(3)
    assert a[0] == pytest.approx((6 + 2 * 0.5) / 12) and a[1] < a[0] and a[2] < a[1]
    # a share that rises is clipped; counts stop after a position nobody reaches
    assert acceptance_prior([0.2, 0.5, 0.0, 0.0], rounds=1).reached == pytest.approx([1, 0.2, 0.2])


def host(step=0.05, per_token=0.002, wait=0.2, shares=(0.4, 0.15, 0.05)) -> HostCosts:
    h = HostCosts(step_s=Ema(0.1, step), per_token_s=Ema(0.1, per_token), wait_s=Ema(0.1, wait))
    h.accept = acceptance_prior(list(shares))
    return h


def test_a_losing_drafter_is_off_from_the_first_token_and_its_first_probe_is_paced():
    h = host()
    policy = SpeculationPolicy(h, max_len=15)
    assert not policy.on and policy.next_len() == 0
    interval = policy.pace()
    # a probe: two rounds at the best length, each step + per-token cost + the wait ...
    n = policy.best
    spent = 2 * (0.05 + 0.002 * n + 0.2)
    tokens = 2 * expected_tokens(policy.accept.rates(n, prior=h.accept))
    # ... paid back when its excess over plain steps is 1 % of the plain decoding in between
    assert interval == min(max(32, int((spent - tokens * 0.05) / (0.01 * 0.05))), 2048)
    assert interval > 500
    # re-reading the skipped tokens stretches it; at 1 % of a step per token, never paid back
    assert policy.pace(catch_up_s=0.0002) > interval
    assert policy.pace(catch_up_s=0.0005) == policy.pace(catch_up_s=0.004) == 2048


def test_a_paying_drafter_speculates_from_the_first_token():
    h = host(wait=0.0, shares=[0.95**k for k in range(1, 16)])
    policy = SpeculationPolicy(h, max_len=15)
    assert policy.on and policy.next_len() > 0


def test_seed_calibrates_a_fresh_host_once_and_leaves_stored_costs_alone():
    model = tiny_model("llama", seed=1)
    drafter = D3DDrafter.from_target(model, 1, base="tiny")
    assert shipped_acceptance(drafter) is None
    drafter.meta.notes["acceptance"] = {"per_position": [0.05, 0.01] + [0.0] * 4}
    assert shipped_acceptance(drafter) == [0.05, 0.01, 0.0, 0.0, 0.0, 0.0]
    h = HostCosts()
    figures = seed(h, model, drafter, drafter.block_size)
    assert figures is not None
    for key in ("step_s", "verify_s", "read_s", "draft_s"):
        assert figures[key] > 0
    assert h.step_s.value == figures["step_s"] and h.wait_s.value == figures["draft_s"]
    assert h.wait_from_cold and h.accept.observed and h.read_s.value is not None
    if not figures["speculate"]:  # nearly nothing is accepted: off, the first probe paced
        assert figures["probe_interval"] > 16 == SpeculationPolicy(HostCosts()).probe_every
    switched: list[bool] = []
    seed(HostCosts(), model, drafter, drafter.block_size, on_switch=switched.append)
    assert switched == [False, True, False]  # step on the plain cores, verify and block not
    assert seed(h, model, drafter, drafter.block_size) is None  # figures there: left alone
    # without a shipped acceptance the host is calibrated but the drafter still gets measured
    bare = HostCosts()
    seed(bare, model, D3DDrafter.from_target(model, 1, base="tiny"), drafter.block_size)
    assert bare.step_s.value is not None and not bare.accept.observed
    assert SpeculationPolicy(bare).next_len() == 15  # measures with the whole block first
