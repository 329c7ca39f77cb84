"""The speculation rule on fake, deterministic costs (no model, no clock)."""

from __future__ import annotations

import pytest

from d3d.batching.policy import AUTO, FORCED, PLAIN, CostModel, decide, row_kind


def costs(fixed: float, per_token: float, draft: float) -> CostModel:
    """A cost model fed with measurements of forward(x) = fixed + per_token * x."""
    m = CostModel()
    for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        m.observe_forward(x, 1, fixed + per_token * x)
    m.observe_draft(draft)
    return m


CPU = costs(fixed=0.037, per_token=0.0036, draft=0.021)  # verify 16 tokens ~ 2.35x a step
GPU = costs(fixed=0.020, per_token=0.00002, draft=0.004)  # weight-bound: 16 tokens ~ 1 step
GPU_SLOW = costs(fixed=0.020, per_token=0.0012, draft=0.004)  # 2 rows x 16: ~2.5 steps


def test_row_kinds():
    assert row_kind("ar") == PLAIN
    assert row_kind("auto") == AUTO
    assert row_kind("sync") == FORCED and row_kind("async") == FORCED


def test_cpu_costs_never_pay_at_this_acceptance():
    for n in (1, 4, 16, 64):
        plan = decide([AUTO] * n, [1.65] * n, 16, CPU)
        assert plan.speculate == [False] * n
        assert plan.plain_rate > plan.spec_rate


def test_cpu_costs_pay_for_a_lone_request_with_a_good_drafter():
    assert decide([AUTO], [6.0], 16, CPU).speculate == [True]


def test_gpu_costs_speculate_alone_and_stop_at_high_batch():
    assert decide([AUTO], [3.0], 16, GPU).speculate == [True]
    big = decide([AUTO] * 512, [3.0] * 512, 16, GPU)
    assert big.speculate == [False] * 512


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_the_switch_point_moves_with_acceptance(batch):
    low = decide([AUTO] * batch, [1.0] * batch, 16, GPU)
    assert not any(low.speculate)  # nothing is ever accepted: speculation only costs


def test_forced_and_plain_rows_keep_their_choice():
    plan = decide([PLAIN, FORCED, AUTO], [9.0, 1.0, 1.0], 16, CPU)
    assert plan.speculate == [False, True, False]
    plan = decide([PLAIN, FORCED, AUTO], [1.0, 1.0, 8.0], 16, GPU)
    assert plan.speculate == [False, True, True]


def test_no_measurement_or_no_drafter_means_plain_steps():
    assert decide([AUTO, AUTO], [5.0, 5.0], 16, CostModel()).speculate == [False, False]
    assert decide([FORCED], [5.0], 16, GPU, can_draft=False).speculate == [False]


def test_cost_model_interpolates_and_extrapolates():
    m = CostModel()
    m.observe_forward(1, 1, 1.0)
    m.observe_forward(1, 16, 2.5)
    assert m.forward(1, 1) == pytest.approx(1.0)
    assert m.forward(2, 4) == pytest.approx(1.0 + 1.5 * 7 / 15)
    assert m.forward(4, 16) == pytest.approx(2.5 + 1.5 / 15 * 48)


def copy_costs(tokens: dict[int, float], tried: int = 2):
    from d3d.lookup import CopyCosts

    c = CopyCosts()
    for b, t in tokens.items():
        c.tokens[b].add(t)
        c.tried[b] = tried
    return c


def test_copies_ride_free_on_a_wide_forward_and_wait_for_costs():
    from d3d.batching.policy import choose_copies

    losing = copy_costs({0: 1.0})
    assert choose_copies([0, None], 16, 16, CPU, losing) == [True, False]
    assert choose_copies([None, None], 1, 16, CPU, losing) == [False, False]
    assert choose_copies([3], 1, 16, CostModel(), copy_costs({})) == [False]  # nothing measured


def test_copies_widen_the_forward_only_where_they_pay():
    from d3d.batching.policy import choose_copies

    # CPU: a 16-token forward costs ~2.35x a step, so a lone copy must emit > 2.35 tokens.
    assert choose_copies([3], 1, 16, CPU, copy_costs({3: 6.0})) == [True]
    assert choose_copies([0], 1, 16, CPU, copy_costs({0: 1.5})) == [False]
    # GPU: the wide forward costs about a step, so any gain pays.
    assert choose_copies([0], 1, 16, GPU, copy_costs({0: 1.5})) == [True]
    # A bucket not yet tried is priced at the prior (4 tokens): tried alone, not at batch 64.
    assert choose_copies([2], 1, 16, CPU, copy_costs({0: 1.0})) == [True]
    assert choose_copies([2] * 64, 1, 16, CPU, copy_costs({0: 1.0})) == [False] * 64
    # A losing bucket is declined, and priced at the prior again after retry_every declined steps
    # (one step counts once, whatever the rows).
    losing = copy_costs({1: 1.0})
    picks = [choose_copies([1, 1], 1, 16, GPU_SLOW, losing, retry_every=4)[0] for _ in range(8)]
    assert picks == [False, False, False, False, True] + [False] * 3
