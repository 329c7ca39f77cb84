"""The one engine, many rows: every mode in one batch gives each request exactly its ``ar``
tokens. (Sampled rows in a batch are exact in distribution: every mode's chi-square test draws
its samples as rows of one scheduler, :func:`tests.engine.test_sampling_exact.sample_many`.)

Real D3D drafters run in a real thread worker (branches per row, one message per step); rows
join mid-flight, prompts differ in length, batches hold 1 to 16 rows.
"""

from __future__ import annotations

import pytest

from d3d.engine import GenRequest
from d3d.model.drafter import D3DDrafter
from tests.conftest import greedy_continuation, tiny_engine, tiny_model

MODES = ("ar", "sync", "async", "auto")


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 90 + 2 for j in range(3 + (11 * i) % 37)] for i in range(n)]


@pytest.fixture(params=["llama", "qwen3"])
def engine(request):
    model = tiny_model(request.param, seed=1)
    eng = tiny_engine(model, D3DDrafter.from_target(model, 1, base="tiny", block_size=6))
    yield eng
    eng.close()


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_mixed_modes_joining_mid_flight_equal_ar_alone(engine, rows):
    model = engine.target.model
    sched = engine.scheduler(max_batch=16)
    sched.eos_ids = set()
    ps = prompts(rows)
    out: list[list[int]] = [[] for _ in ps]
    stats: list = [None] * rows
    budgets = [12 + (5 * i) % 17 for i in range(rows)]

    def add(i: int) -> None:
        def done(st, err, i=i):
            assert err is None, err
            stats[i] = st

        sched.add(
            GenRequest(
                ps[i], budgets[i], mode=MODES[i % 4], on_tokens=out[i].extend, on_finish=done
            )
        )

    for i in range(rows):  # half start together, the rest join one per step
        add(i)
        if i >= rows // 2:
            sched.step()
    while not sched.idle:
        sched.step()
    for i in range(rows):
        assert out[i] == greedy_continuation(model, ps[i], budgets[i]), f"row {i} ({MODES[i % 4]})"
        assert stats[i].worker_failures == 0
    asyncs = [st for i, st in enumerate(stats) if MODES[i % 4] == "async"]
    assert all(st.branch_hits + st.branch_misses == st.num_drafts > 0 for st in asyncs)


def test_rows_are_told_their_share_of_a_batched_step():
    """Before proposing, every row that prices its rounds hears what its plain token costs in
    this step: the fitted forward cost over the rows when several share it, None alone."""
    from d3d.decoding.proposers import ArProposer
    from d3d.engine import Scheduler

    told: list[tuple[int, float | None]] = []

    class Priced(ArProposer):
        def batch(self, share_s, token_s=None):
            told.append((len(sched.rows), share_s))

    sched = Scheduler(tiny_model("llama", seed=1), set(), lambda req: Priced(), max_kv_tokens=4096)
    for p in prompts(3):
        sched.add(GenRequest(p, 6, mode="ar"))
    while not sched.idle:
        sched.step()
    shared = [s for rows, s in told if rows == 3 and s is not None]
    assert shared and all(s > 0 for s in shared)
    a, b = sched.prefill_budget.cost.fit()
    assert sched.share_s(3) == pytest.approx((a + 3 * b) / 3)
    told.clear()
    sched.add(GenRequest(prompts(1)[0], 4, mode="ar"))
    while not sched.idle:
        sched.step()
    assert told and all(s is None for _, s in told)
