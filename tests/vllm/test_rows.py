"""The vLLM adapter's row bookkeeping (:mod:`d3d.vllm.rows`) under a fake engine that behaves
like vLLM: it names rows by request id only, verifies the drafts it is given with the target's
greedy choice (accept the longest matching prefix, then the target's token), and says nothing
when requests join, finish, are preempted or resume. Every request must come out exactly as
plain greedy decoding of the target, whatever the drafter does, and the proposers must be the
project's own (a scripted worker stands in for the drafter process)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from d3d.decoding.policy import HostCosts
from d3d.vllm.rows import RequestRows, RowView
from d3d.worker.modes import ModeKit
from d3d.worker.proposer import BatchedLink
from d3d.worker.protocol import Commits
from tests.concurrency.fakes import ScriptedWorker
from tests.conftest import OracleDrafter, greedy_continuation, tiny_model

K = 7
TARGET = tiny_model("llama", seed=1)
V = TARGET.config.vocab_size


def next_tokens(ids: list[int], n: int) -> list[int]:
    return greedy_continuation(TARGET, ids, n)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    mode: str
    join: int = 0  # the step it arrives at
    away: tuple[int, ...] = ()  # steps it is preempted for (absent from the batch)
    tokens: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    reading: int = 1  # prompt chunks before its first token (steps with nothing sampled)
    recomputed: bool = False

    @property
    def out(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_tokens


def run(reqs: list[Req], rows: RequestRows, steps: int = 400, finish: bool = True) -> None:
    """Step a fake vLLM over ``reqs`` until every one is done (or ``steps`` ran: ``finish``
    False)."""
    for step in range(steps):
        views = []
        batch = [r for r in reqs if r.join <= step and not r.done and step not in r.away]
        if not batch and all(r.done for r in reqs):
            return
        for r in batch:
            if not r.tokens:
                r.tokens = list(r.prompt)
            if r.reading > 0:  # a prompt chunk: nothing sampled yet
                r.reading -= 1
                views.append(RowView(r.rid, r.mode, list(r.tokens), [], r.max_tokens))
                continue
            want = min(len(r.drafts), r.max_tokens - len(r.out) - 1)
            truth = next_tokens(r.tokens, want + 1)
            k = 0
            while k < want and r.drafts[k] == truth[k]:
                k += 1
            sampled = truth[: k + 1]
            r.tokens += sampled
            views.append(RowView(r.rid, r.mode, list(r.tokens), sampled, r.max_tokens - len(r.out)))
        drafts = rows.step(views)
        for v, d in zip(views, drafts, strict=True):
            req = next(r for r in reqs if r.rid == v.req_id)
            assert len(d) <= K and all(0 <= t < V for t in d)
            if v.budget is not None and v.sampled:
                assert len(d) <= max(v.budget - 1, 0), "never more drafts than the budget holds"
            req.drafts = d
        for r in reqs:  # a preempted request loses its drafts (vLLM recomputes it)
            if step in r.away:
                r.drafts = []
    if finish:
        raise AssertionError("the fake engine did not finish")


def make_rows(script=("hit",), wrong=False) -> tuple[RequestRows, ScriptedWorker]:
    worker = ScriptedWorker(OracleDrafter(TARGET, block_size=K + 1, wrong=wrong), script)
    link = BatchedLink(worker)
    kit = ModeKit(HostCosts(), V, max_len=K, link=link)
    return RequestRows(lambda mode, budget: kit.proposer(mode, budget), link.flush, K), worker


PROMPTS = [[1, 5, 9], [2, 7, 3, 8, 11, 4, 6, 10, 12], [3], [9, 9, 2, 5, 1, 7]]


@pytest.mark.parametrize("wrong", [False, True])
def test_mixed_modes_joins_and_preemption_give_plain_greedy(wrong):
    rows, worker = make_rows(wrong=wrong)
    modes = ["ar", "sync", "async", "auto"]
    reqs = [
        Req(f"r{i}", p, 20 + 3 * i, modes[i % 4], join=2 * i, away=(9, 10) if i == 1 else ())
        for i, p in enumerate(PROMPTS * 2)
    ]
    run(reqs, rows)
    for r in reqs:
        assert r.out == next_tokens(r.prompt, r.max_tokens), (r.rid, r.mode)
    assert rows.resyncs == 0  # a preempted request is closed, then started again
    rows.step([])  # the next step (vLLM's next call) closes what finished in the last one
    assert not rows.live, "every finished request's session is closed"
    async_stats = rows.stats("r2")
    assert async_stats is not None and async_stats["num_drafts"] > 0
    if not wrong:
        assert async_stats["num_accepted_tokens"] > 0 and async_stats["branch_hits"] > 0
    assert rows.stats("r0") is None, "ar requests cost the adapter nothing"
    assert worker.closed, "sessions were closed in the worker"


def test_tokens_out_of_step_resynchronise_the_request():
    rows, _ = make_rows()
    r = Req("x", PROMPTS[1], 24, "async")
    run([r], rows, steps=4, finish=False)  # a few rounds in
    truth = next_tokens(r.prompt, 24)
    # vLLM recomputed the request: its row comes back one token shorter than the proposer knew
    r.tokens = r.tokens[:-1]
    r.drafts = []
    run([r], rows)
    assert r.out == truth and rows.resyncs == 1


def test_a_dead_worker_costs_speculation_not_tokens():
    rows, worker = make_rows(script=("hit", "hit", "die"))
    reqs = [Req(f"d{i}", p, 18, "async") for i, p in enumerate(PROMPTS)]
    run(reqs, rows)
    for r in reqs:
        assert r.out == next_tokens(r.prompt, r.max_tokens)
    assert not worker.alive
    failed = sum(rows.stats(r.rid)["worker_failures"] for r in reqs)
    assert failed >= 1


def test_step_timing_prices_rows_in_a_batch():
    clock = iter(range(1000))
    rows, _ = make_rows()
    rows.clock = lambda: float(next(clock))
    reqs = [Req(f"t{i}", p, 12, "auto") for i, p in enumerate(PROMPTS)]
    run(reqs, rows)
    assert rows.cost.samples, "every step after the first was timed over its width"
    assert all(t > 0 for _, t in rows.cost.samples)


def test_a_batched_step_tells_the_worker_its_verify_time():
    """The worker's branch budget must see the verification its branches overlap: in a batch,
    the rounds that verified the widest block report the step's time, as on the own engine
    (before, only a row alone did, so a batch's commits carried 0 and the budget never learnt
    the batched verify)."""
    clock = iter(range(10_000))
    rows, worker = make_rows()
    rows.clock = lambda: float(next(clock))
    steps: list[list] = []
    send = worker.send

    def record(msg):
        if isinstance(msg, Commits):
            steps.append(msg.items)
        send(msg)

    worker.send = record
    reqs = [Req(f"v{i}", p, 16, "async") for i, p in enumerate(PROMPTS)]
    run(reqs, rows)
    for r in reqs:
        assert r.out == next_tokens(r.prompt, r.max_tokens)
    seen: set[int] = set()
    batched = []
    for items in steps:  # a session's first commit is its prefill's (round 0)
        if len(items) > 1 and all(c.sid in seen for c in items):
            batched.append(max(c.verify_s for c in items))
        seen.update(c.sid for c in items)
    assert batched, "the requests decoded together"
    assert all(v > 0 for v in batched), batched


def test_rows_ignore_what_vllm_has_not_sampled():
    rows, _ = make_rows()
    out = rows.step([RowView("p", "async", [1, 2, 3], [], 10)])
    assert out == [[]] and not rows.live


def test_budget_zero_gets_no_drafts():
    rows, _ = make_rows()
    out = rows.step([RowView("b", "async", [1, 2, 3, 4], [4], 1)])
    assert out == [[]]
    assert torch.tensor(out[0]).numel() == 0
