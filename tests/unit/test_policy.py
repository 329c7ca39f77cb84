"""``auto``'s rule, driven by fake costs and acceptance: speculate only when, and only as far
ahead as, the measured rate beats the target's."""

import random

import pytest

from d3d.config import SamplingConfig
from d3d.decoding.policy import HostCosts, PositionStats, SpeculationPolicy, expected_tokens

STEP, PER_TOKEN = 0.040, 0.0037  # this CPU: a 16-token verify costs ~2.4 steps


class SpecDouble:
    """A speculating proposer auto wraps: a whole block every round until ``failed`` (its
    worker gone), recording what auto told it (``first_len``, ``next_len``)."""

    failed = False
    speculating = True

    def start(self, *args, first_len=None):
        self.first_len = first_len

    def propose(self, tokens):
        import torch

        from d3d.decoding.proposers import NO_DRAFT, Proposal

        return NO_DRAFT if self.failed else Proposal(torch.arange(15))

    def observe(self, acc, verify_s, next_len=None):
        self.next_len = next_len

    def close(self):
        pass


def simulate(policy, n_tokens, accept, wait=0.0, cold_extra=0.0, seed=0):
    """Decode n tokens with fixed costs; ``accept(i)``: chance that draft i+1 is accepted.
    Returns (speculative rounds, plain steps, seconds, draft lengths used)."""
    rng = random.Random(seed)
    spec = plain = tokens = 0
    seconds, prev_spec, lengths = 0.0, False, []
    while tokens < n_tokens:
        n = policy.next_len()
        if n:
            acc = 0
            while acc < n and rng.random() < accept(acc):
                acc += 1
            first = not prev_spec
            verify = STEP + PER_TOKEN * n
            w = wait + (cold_extra if first else 0.0)
            policy.record(n, acc, acc + 1, verify, w, first)
            spec, tokens, seconds, prev_spec = (
                spec + 1,
                tokens + acc + 1,
                seconds + verify + w,
                True,
            )
            lengths.append(n)
        else:
            policy.record(0, 0, 1, STEP, 0.0, False)
            plain, tokens, seconds, prev_spec = plain + 1, tokens + 1, seconds + STEP, False
    return spec, plain, seconds, lengths


def test_expected_tokens():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tokens([1.0] * 15) == 16.0


def test_position_stats_count_reached_and_accepted():
    s = PositionStats(decay=1.0)
    s.update(drafted=4, num_accepted=1)  # d1 accepted, d2 rejected, d3/d4 never tried
    s.update(drafted=4, num_accepted=4)
    assert s.reached == [2, 2, 1, 1] and s.accepted == [2, 1, 1, 1]
    s2 = PositionStats(decay=0.5)
    s2.update(drafted=4, num_accepted=4)
    s2.update(drafted=1, num_accepted=0)  # only position 1 tried: only it forgets
    assert s2.reached == [1.5, 1, 1, 1] and s2.accepted == [0.5, 1, 1, 1]
    assert s.rates(2, strength=0.0) == [1.0, 0.5]


def test_a_weak_drafter_is_switched_off_and_probed_rarely():
    host = HostCosts()
    _, _, seconds, _ = simulate(SpeculationPolicy(host), 512, lambda i: 0.3, wait=0.020)
    assert seconds <= 1.03 * 512 * STEP, "never more than a few per cent slower than ar"
    nxt = SpeculationPolicy(host)
    assert not nxt.on, "the host remembers: the next request starts with speculation off"
    spec2, _, seconds2, _ = simulate(nxt, 512, lambda i: 0.3, wait=0.020, seed=1)
    assert seconds2 <= 1.02 * 512 * STEP and spec2 <= 12


def test_a_half_accepted_drafter_pays_with_short_drafts():
    rates = [0.5, 0.4, 0.33, 0.3] + [0.25] * 11
    policy = SpeculationPolicy(HostCosts())
    _spec, _, seconds, _lengths = simulate(policy, 1024, lambda i: rates[i])
    assert policy.on and 1 <= policy.best <= 4, "verifying the whole block would lose here"
    assert seconds < 0.85 * 1024 * STEP
    # with the whole block verified every round it is slower than ar
    full = 1024 / expected_tokens(rates) * (STEP + 15 * PER_TOKEN)
    assert full > 1024 * STEP


def test_a_strong_drafter_verifies_the_whole_block():
    policy = SpeculationPolicy(HostCosts())
    _, plain, seconds, lengths = simulate(policy, 1024, lambda i: 0.99)
    assert policy.best == 15 and lengths[-1] == 15
    assert plain == 1, "one plain step to measure the step time, then speculation"
    assert seconds < 0.4 * 1024 * STEP


def test_a_probe_switches_speculation_back_on_when_acceptance_rises():
    policy = SpeculationPolicy(HostCosts())
    simulate(policy, 128, lambda i: 0.2, wait=0.010)
    assert not policy.on
    _, plain, _, _ = simulate(policy, 1024, lambda i: 0.9, wait=0.010)
    assert policy.on and plain < 512, "back on within a few probe intervals"


def test_the_cold_first_round_of_a_run_does_not_count_against_speculation():
    # the first round after plain steps waits a whole second for a cold draft: it stands in for
    # the wait only until the first warm round replaces it
    policy = SpeculationPolicy(HostCosts())
    _, plain, _, _ = simulate(policy, 512, lambda i: 0.9, cold_extra=1.0)
    assert plain <= 20 and policy.on and not policy.host.wait_from_cold


def test_break_even_speculation_stays_off():
    # every draft rejected: one token per round at more than a step's cost
    policy = SpeculationPolicy(HostCosts())
    simulate(policy, 256, lambda i: 0.0)
    assert not policy.on


def test_many_short_requests_with_an_expensive_drafter_stay_near_ar():
    # a drafter whose block costs 5 steps (deeper than the verify), accepted 70%:
    # it never pays here; probing is paced over the host's traffic, not per request
    host = HostCosts()
    total = 0.0
    for i in range(16):
        _, _, seconds, _ = simulate(SpeculationPolicy(host), 128, lambda i: 0.7, wait=0.2, seed=i)
        total += seconds
    assert total <= 1.03 * 16 * 128 * STEP


def test_auto_takes_plain_steps_and_gives_the_cores_back_once_its_worker_failed():
    """A drafter that pays, then its worker fails: plain steps to the end of the request, and
    the proposer says when it needs the drafter's cores (speculating, then plain), which is
    what the engine sizes the target's CPU budget from after every step."""

    from d3d.decoding.policy import AutoProposer
    from d3d.decoding.verify import Acceptance

    host = _paying_host()
    spec = SpecDouble()
    auto = AutoProposer(spec, host)
    auto.start([1, 2, 3], SamplingConfig(), None)
    assert spec.first_len > 0 and auto.speculating
    auto.observe(Acceptance(0, [7]), 0.1)  # the prefill
    assert auto.propose([]).k > 0
    auto.observe(Acceptance(15, list(range(16))), STEP + 15 * PER_TOKEN)
    spec.failed = True
    auto.propose([])
    auto.observe(Acceptance(0, [9]), STEP)
    assert auto.next_len == 0 and spec.next_len == 0 and not auto.speculating
    for _ in range(200):  # no probe ever again in this request
        assert auto.propose([]).k == 0
        auto.observe(Acceptance(0, [9]), STEP)


def test_expensive_probes_are_spaced_by_what_they_cost():
    """Every probe's first round waits a second for a cold drafter to read the text (an idle
    drafter does not read along): after the first losing probe the next waits until that
    cost is a small share of the plain decoding between probes."""
    host = HostCosts()
    total = 0.0
    for i in range(32):
        policy = SpeculationPolicy(host)
        _, _, seconds, _ = simulate(policy, 128, lambda i: 0.3, wait=0.2, cold_extra=1.0, seed=i)
        total += seconds
    assert total <= 1.03 * 32 * 128 * STEP
    assert host.probe_interval == policy.max_probe_every


def _paying_host() -> HostCosts:
    host = HostCosts()
    for _ in range(8):  # a host that has seen this drafter pay
        host.step_s.add(STEP)
        host.per_token_s.add(PER_TOKEN)
        host.wait_s.add(0.0)
        host.accept.update(drafted=15, num_accepted=15)
    return host


@pytest.mark.parametrize(
    "budget, typical, starts_at",
    [(24, None, None), (512, None, 106), (512, 400.0, 2), (512, 30.0, 106), (None, None, 2)],
)
def test_auto_starts_speculating_only_when_the_drafters_catch_up_can_pay_back(
    budget, typical, starts_at
):
    """A measuring step first (the host has no step time), then a drafter that has read none of
    a 2,000-token prompt: at a prefill cost of 1 ms per token its catch-up (2 s + 1 ms per token
    produced) pays back only if half the plain decoding of the tokens still to come covers it,
    i.e. 100+ of them. What is still to come: what the budget leaves, no more than the host's
    typical answer leaves, or than the request has produced so far when that is more. A fresh
    host (no typical answer) or one of short answers speculates from token 106 of a 512-token
    budget, one of 400-token answers at once, a 24-token budget never, no budget at once."""

    from d3d.decoding.policy import AutoProposer
    from d3d.decoding.proposers import NO_DRAFT
    from d3d.decoding.verify import Acceptance

    host = _paying_host()
    host.step_s.value = None  # this engine's first request: one plain step is measured first
    host.answer_len.value = typical
    spec = SpecDouble()
    auto = AutoProposer(spec, host, budget=budget)
    auto.start(list(range(2000)), SamplingConfig(), None)
    assert spec.first_len == 0
    auto.observe(Acceptance(0, [7]), 2.0)  # the prefill: 1 ms per prompt token
    assert auto.propose([]) is NO_DRAFT
    auto.observe(Acceptance(0, [8]), STEP)
    while auto.next_len == 0 and auto.produced < (budget or 300):
        assert auto.propose([]).k == 0
        auto.observe(Acceptance(0, [9]), STEP)
    assert (auto.produced if auto.next_len > 0 else None) == starts_at
    auto.close()
    assert host.answer_len.value is not None  # the request's length is the host's now


def test_a_host_that_speculates_still_leaves_a_short_answer_to_a_long_prompt_plain():
    """The host's drafter pays and its prefill cost per token is known from earlier requests:
    a 24-token answer to a 2,000-token prompt starts plain (the drafter need not read the
    prompt), a 512-token one speculates from the first round, unless the host's answers are
    typically short (then the budget is no guide: it starts plain too)."""

    from d3d.decoding.policy import AutoProposer

    for typical, budget, first_len in ((512, 24, 0), (512, 512, 15), (24, 512, 0)):
        host = _paying_host()
        host.read_s.add(0.001)
        host.answer_len.add(typical)
        spec = SpecDouble()
        AutoProposer(spec, host, budget=budget).start(list(range(2000)), SamplingConfig(), None)
        assert spec.first_len == first_len


def test_auto_starts_no_speculative_run_while_the_drafters_device_reads_a_document():
    """A drafter process shares its core with the document reader: while it reads, a run that
    would start waits (plain steps), and one under way may go on."""

    from d3d.decoding.policy import AutoProposer
    from d3d.decoding.verify import Acceptance

    reading = [True]
    auto = AutoProposer(SpecDouble(), _paying_host(), busy=lambda: reading[0])
    auto.start([1, 2, 3], SamplingConfig(), None)
    assert auto.next_len == 0, "busy at the start: plain"
    auto.observe(Acceptance(0, [7]), 0.1)
    assert auto.next_len == 0 and auto.propose([]).k == 0
    reading[0] = False
    auto.observe(Acceptance(0, [8]), STEP)
    assert auto.next_len > 0, "free again: speculation pays and starts"
    reading[0] = True
    assert auto.propose([]).k > 0
    auto.observe(Acceptance(15, list(range(16))), STEP + 15 * PER_TOKEN)
    assert auto.next_len > 0, "a run under way goes on"


def test_in_a_batch_a_round_must_beat_the_rows_share_of_the_step():
    """A drafter accepted half the time pays alone (a plain step is 40 ms) but not where the
    row's plain token costs 2 ms of a batched step: the same figures, priced at the share, take
    plain steps; alone again, it speculates. A batch's time is no row's own step: the host's
    plain step is not learned from it."""
    from d3d.decoding.policy import AutoProposer
    from d3d.decoding.verify import Acceptance

    host = _paying_host()
    host.accept = PositionStats()
    for _ in range(30):
        host.accept.update(drafted=4, num_accepted=2)
    auto = AutoProposer(SpecDouble(), host)
    auto.start([1, 2, 3], SamplingConfig(), None)
    auto.observe(Acceptance(0, [7]), 0.1)
    assert auto.next_len > 0, "alone it pays"
    auto.batch(0.002, PER_TOKEN)
    auto.propose([])
    auto.observe(Acceptance(2, [4, 5, 6]), 0.5)  # a wide batched forward
    assert auto.next_len == 0, "at a 2 ms share it does not"
    assert host.step_s.value == pytest.approx(STEP), "a batched step taught the host nothing"
    auto.batch(None)
    auto.propose([])
    auto.observe(Acceptance(0, [8]), STEP)
    assert auto.next_len > 0


def test_in_a_batch_a_copy_is_cut_to_what_pays_at_the_rows_share():
    """A one-token match accepted a third of the time: verified short it pays alone; at a 1 ms
    share of a batched step (each verified token costs 3.7 ms of forward) it does not."""
    import torch

    from d3d.decoding.lookup import CopyCosts, CopyDraft, CopyDrafts
    from d3d.decoding.policy import AutoProposer

    host = _paying_host()
    copies = CopyDrafts(host.copy, max_len=15, vocab_size=50)
    for i in range(60):
        copies.record(CopyDraft(torch.arange(4), None, 0), num_accepted=int(i % 3 == 0))
    auto = AutoProposer(None, host, copies=copies)
    auto.start([1, 2, 3], SamplingConfig(), None)
    text = [8, 1, 2, 3, 9, 4, 5, 6, 7, 1]
    alone = auto.propose(text)
    assert alone.source == "copy" and 0 < alone.k < 4
    auto.batch(0.001, PER_TOKEN)
    assert auto.propose(text).k == 0
    assert isinstance(host.copy, CopyCosts)
