"""The asynchronous pipeline serving a batch: the engine's scheduler with several ``async`` rows
(and ``ar`` / ``sync`` rows beside them), a scripted worker and a fake clock.

- The worker gets one step's commits as one message, after that step's verification, and every
  block for step t+1 reaches the target after step t was verified.
- Hits and misses are counted per row.
- A row cancelled mid-flight closes its session; the other rows go on.
- A worker that dies or hangs costs speculation only: every row finishes on the target alone
  with exactly its ``ar`` tokens.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.engine import GenRequest, Scheduler
from d3d.worker import AsyncProposer
from d3d.worker.proposer import BatchedLink
from tests.concurrency.fakes import FakeClock, ScriptedWorker
from tests.conftest import TINY_VOCAB, OracleDrafter, greedy_continuation, tiny_model

PROMPTS = [list(range(2, 30)), [5, 9, 11, 3], list(range(40, 52)), [7] * 9]
N = 30


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def reference(target):
    return [greedy_continuation(target, p, N) for p in PROMPTS]


class Rows:
    """A scheduler whose ``async`` rows share one scripted worker behind a batching link."""

    def __init__(self, target, worker: ScriptedWorker, clock: FakeClock, modes):
        self.link = BatchedLink(worker)
        self.out = [[] for _ in modes]
        self.stats = [None] * len(modes)
        self.errors = [None] * len(modes)
        oracle = OracleDrafter(target, wrong=True)

        def proposer(req: GenRequest):
            if req.mode == "async":
                return AsyncProposer(self.link, TINY_VOCAB, min_timeout=5.0, clock=clock)
            return SyncProposer(oracle) if req.mode == "sync" else ArProposer()

        self.sched = Scheduler(
            target, set(), proposer, max_kv_tokens=4096, after_step=lambda rows: self.link.flush()
        )
        self.reqs = []
        for i, (prompt, mode) in enumerate(zip(PROMPTS, modes, strict=True)):
            req = GenRequest(
                list(prompt),
                N,
                mode=mode,
                on_tokens=self.out[i].extend,
                on_finish=lambda st, err, i=i: self._done(i, st, err),
            )
            self.reqs.append(req)

    def _done(self, i, stats, error):
        self.stats[i], self.errors[i] = stats, error

    def run(self, join_at=(0, 0, 0, 0), cancel=None):
        """Add each request at its step, cancel ``cancel`` = (row, step), step to the end."""
        for step in itertools.count():
            for i, at in enumerate(join_at):
                if at == step:
                    self.sched.add(self.reqs[i])
            if cancel is not None and cancel[1] == step:
                self.reqs[cancel[0]].cancel()
            if step > max(join_at) and self.sched.idle:
                return
            self.sched.step()


def test_one_message_per_step_and_no_block_before_its_step_was_verified(target, reference):
    events: list = []
    worker = ScriptedWorker(OracleDrafter(target), ["hit", "miss"], events=events)
    rows = Rows(target, worker, FakeClock(), ["async", "async", "ar", "async"])
    hook = target.register_forward_hook(lambda *_: events.append(("forward",)))
    try:
        rows.run()
    finally:
        hook.remove()
    assert rows.out == reference
    # Every Commits message carries several rows, and every block follows a forward.
    assert worker.batches and max(len(b) for b in worker.batches) == 3
    for prev, cur in itertools.pairwise(events):
        if cur[0] == "commits":
            assert prev == ("forward",), "a step's commits go out after its verify forward"
    # No row gets two blocks without a verify forward between them, and its positions grow.
    since_forward: set[int] = set()
    last_pos: dict[int, int] = {}
    for e in events:
        if e[0] == "forward":
            since_forward.clear()
        elif e[0] == "deliver":
            _, pos, sid = e
            assert sid not in since_forward, "a block for step t+1 before step t was verified"
            assert pos > last_pos.get(sid, -1)
            since_forward.add(sid)
            last_pos[sid] = pos
    assert len(last_pos) == 3


def test_hits_and_misses_are_counted_per_row(target, reference):
    worker = ScriptedWorker(OracleDrafter(target, wrong=True), ["hit", "miss"])
    rows = Rows(target, worker, FakeClock(), ["async", "async", "async", "sync"])
    rows.run(join_at=(0, 0, 2, 3))
    assert rows.out == reference
    for st in rows.stats[:3]:
        assert st.num_drafts > 5 and st.branch_hits + st.branch_misses == st.num_drafts
    assert sum(st.branch_misses for st in rows.stats[:3]) >= 1
    assert rows.stats[3].branch_hits == 0 and rows.stats[3].num_drafts > 0  # sync: no branches


def test_a_row_cancelled_mid_flight_closes_its_session_and_the_rest_go_on(target, reference):
    worker = ScriptedWorker(OracleDrafter(target, wrong=True), ["hit"])
    rows = Rows(target, worker, FakeClock(), ["async", "async", "async", "ar"])
    rows.run(cancel=(1, 4))
    assert rows.stats[1].stop_reason == "cancelled" and len(rows.out[1]) < N
    assert rows.out[1] == reference[1][: len(rows.out[1])]
    assert 2 in worker.closed  # row 1's session (ids start at 1)
    for i in (0, 2, 3):
        assert rows.out[i] == reference[i]


@pytest.mark.parametrize("failure", ["hang", "die", "fail"])
def test_a_worker_that_fails_leaves_every_row_to_the_target(target, reference, failure, caplog):
    clock = FakeClock()
    worker = ScriptedWorker(OracleDrafter(target), ["hit"] * 4 + [failure], clock=clock)
    rows = Rows(target, worker, clock, ["async", "async", "async", "ar"])
    with caplog.at_level(logging.WARNING):
        rows.run()
    assert rows.out == reference, "nothing lost"
    assert all(e is None for e in rows.errors)
    failed = [st.worker_failures for st in rows.stats[:3]]
    assert all(f <= 1 for f in failed) and sum(failed) >= 1
    assert "target alone" in caplog.text
    if failure == "hang":  # each hung row waited its timeout once, then never again
        assert clock.now <= 3 * 5.0 + 1e-9


@pytest.mark.parametrize("script", [["hit"], ["miss"]])
def test_hit_steps_are_steps_where_every_drafting_row_hit(target, reference, script):
    worker = ScriptedWorker(OracleDrafter(target, wrong=True), script)
    rows = Rows(target, worker, FakeClock(), ["async", "async", "ar", "async"])
    rows.run()
    assert rows.out == reference
    steps = [st.hit_steps for st in rows.stats[:2]]
    if script == ["hit"]:
        assert all(n > 0 for n in steps)
        assert all(st.hit_step_seconds >= st.hit_step_verify_seconds > 0 for st in rows.stats[:2])
    else:
        assert steps == [0, 0] and rows.stats[0].hit_step_seconds == 0.0
