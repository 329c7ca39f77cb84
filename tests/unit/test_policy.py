"""``auto``'s rule, driven by fake costs: speculate only when the measured rate beats the target's."""

import pytest

from d3d.policy import HostCosts, SpeculationPolicy


def simulate(policy, n_tokens, step_s, round_s, al, cold_extra=0.0):
    """Decode n tokens with fixed costs; returns (spec rounds, plain steps, seconds)."""
    spec = plain = 0
    seconds, tokens, prev_spec = 0.0, 0, False
    while tokens < n_tokens:
        if policy.speculate():
            first = not prev_spec
            t = round_s + (cold_extra if first else 0.0)
            policy.record(True, al, t, first)
            spec, tokens, seconds, prev_spec = spec + 1, tokens + al, seconds + t, True
        else:
            policy.record(False, 1, step_s, False)
            plain, tokens, seconds, prev_spec = plain + 1, tokens + 1, seconds + step_s, False
    return spec, plain, seconds


def test_losing_speculation_is_switched_off_and_probed_rarely():
    host = HostCosts()
    spec, _plain, seconds = simulate(SpeculationPolicy(host), 512, 0.040, 0.100, 2)
    ar_seconds = 512 * 0.040
    assert seconds <= 1.03 * ar_seconds, "never more than a few per cent slower than ar"
    assert spec <= 16
    # the host remembers: the next request starts with speculation off
    nxt = SpeculationPolicy(host)
    assert nxt.host.step_s.value is not None and not nxt.on
    spec2, _, seconds2 = simulate(nxt, 512, 0.040, 0.100, 2)
    assert spec2 < spec and seconds2 <= 1.02 * ar_seconds


def test_winning_speculation_stays_on():
    _spec, plain, seconds = simulate(SpeculationPolicy(HostCosts()), 512, 0.040, 0.100, 4)
    assert plain == 1, "one plain step to measure the step time, then speculation"
    assert seconds < 0.7 * 512 * 0.040


def test_a_probe_switches_speculation_back_on_when_acceptance_rises():
    host = HostCosts()
    policy = SpeculationPolicy(host)
    simulate(policy, 64, 0.040, 0.100, 2)
    assert not policy.on
    _spec, plain, _ = simulate(policy, 512, 0.040, 0.100, 6)
    assert policy.on and plain <= 64


def test_the_cold_first_round_of_a_run_does_not_count_against_speculation():
    # the first round after plain steps waits for a cold draft: 1 s extra, yet the rule holds
    _spec, plain, _seconds = simulate(SpeculationPolicy(HostCosts()), 512, 0.040, 0.100, 4, 1.0)
    assert plain == 1


@pytest.mark.parametrize("al", [1, 2])
def test_the_margin_keeps_break_even_speculation_off(al):
    # al tokens per 0.040 * al seconds: exactly ar's rate, so speculation must not win
    policy = SpeculationPolicy(HostCosts())
    simulate(policy, 256, 0.040, 0.040 * al, al)
    assert not policy.on
