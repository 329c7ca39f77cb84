"""The asynchronous pipeline's ordering and failure rules, with a scripted worker and a fake clock.

- A block for round t+1 never reaches the target before round t's verification has ended.
- Hits and misses are counted as the worker reports them; stale blocks are discarded.
- A worker that fails, hangs or dies costs the request its speculation only: it finishes on
  the target alone with the same tokens, and the failure is logged and counted once.
- A cancelled request closes its session on the worker; the worker serves the next one.
"""

import itertools
import logging

import pytest

from d3d.config import DecodeConfig
from d3d.decoding.proposers import ArProposer
from d3d.decoding.stats import DecodeStats
from d3d.decoding.verify import Acceptance
from d3d.engine import decode
from d3d.model.drafter import D3DDrafter
from d3d.worker import AsyncProposer, ServerConfig, ThreadWorker
from d3d.worker.workers import wait_until
from tests.concurrency.fakes import FakeClock, ScriptedWorker
from tests.conftest import TINY_VOCAB, OracleDrafter, tiny_model

PROMPT = list(range(2, 30))


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def reference(target):
    cfg = DecodeConfig(mode="ar", max_new_tokens=40)
    return [t for c in decode(target, ArProposer(), PROMPT, cfg, set()) for t in c]


def run(target, proposer, n=40):
    stats = DecodeStats(mode=proposer.name)
    cfg = DecodeConfig(mode=proposer.name, max_new_tokens=n)
    out = [t for c in decode(target, proposer, PROMPT, cfg, set(), stats) for t in c]
    return out, stats


def test_a_block_never_reaches_the_target_before_the_previous_verification_ends(target, reference):
    events: list = []
    hook = target.register_forward_hook(lambda *_: events.append(("verified",)))
    try:
        worker = ScriptedWorker(OracleDrafter(target, wrong=True), ["hit", "miss"], events=events)
        out, stats = run(target, AsyncProposer(worker, TINY_VOCAB))
    finally:
        hook.remove()
    assert out == reference
    assert events[0] == ("verified",), "the prefill comes first"
    delivered = [e for e in events if e[0] == "deliver"]
    assert len(delivered) == stats.num_drafts > 5
    for prev, cur in itertools.pairwise(events):
        if cur[0] == "deliver":
            assert prev == ("verified",), "each block follows the end of a verification"
    positions = [e[1] for e in delivered]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


def test_hits_and_misses_are_counted(target, reference):
    worker = ScriptedWorker(OracleDrafter(target, wrong=True), ["hit", "miss", "miss", "hit"])
    out, stats = run(target, AsyncProposer(worker, TINY_VOCAB))
    assert out == reference
    assert stats.branch_hits == stats.num_drafts - 2 and stats.branch_misses == 2
    assert stats.hit_rate == pytest.approx(stats.branch_hits / stats.num_drafts)


def test_stale_blocks_are_discarded(target, reference):
    worker = ScriptedWorker(OracleDrafter(target), ["stale"])
    out, stats = run(target, AsyncProposer(worker, TINY_VOCAB))
    assert out == reference
    assert stats.acceptance_length == 16.0, "only the block for the right length was used"


@pytest.mark.parametrize("failure", ["fail", "hang", "die"])
def test_a_failing_worker_costs_only_speculation(target, reference, failure, caplog):
    clock = FakeClock()
    worker = ScriptedWorker(OracleDrafter(target), ["hit", failure], clock=clock)
    proposer = AsyncProposer(worker, TINY_VOCAB, min_timeout=5.0, clock=clock)
    with caplog.at_level(logging.WARNING):
        out, stats = run(target, proposer)
    assert out == reference, "nothing lost"
    assert stats.worker_failures == 1
    assert stats.num_drafts == 1, "after the failure the target goes on alone"
    assert stats.ar_tokens == len(reference) - 1 - 16
    assert "target alone" in caplog.text
    if failure == "hang":
        assert clock.now == pytest.approx(5.0), "it waited exactly its timeout, once"
    else:
        assert clock.now == 0.0


def test_cancelling_a_request_closes_its_session(target, reference):
    worker = ScriptedWorker(OracleDrafter(target, wrong=True), ["hit"])
    cfg = DecodeConfig(mode="async", max_new_tokens=40)
    gen = decode(target, AsyncProposer(worker, TINY_VOCAB), PROMPT, cfg, set())
    got = next(gen) + next(gen)
    gen.close()  # the client went away
    assert worker.closed == [1] and 1 not in worker.boxes
    assert got == reference[: len(got)]
    out, _ = run(target, AsyncProposer(worker, TINY_VOCAB))
    assert out == reference


def test_real_thread_worker_survives_a_cancelled_request(target, reference):
    worker = ThreadWorker(D3DDrafter.from_target(target, 1), ServerConfig(max_branches=4))
    try:
        assert worker.wait_ready(10)
        cfg = DecodeConfig(mode="async", max_new_tokens=40)
        gen = decode(target, AsyncProposer(worker, TINY_VOCAB), PROMPT, cfg, set())
        next(gen), next(gen), next(gen)
        gen.close()
        assert wait_until(lambda: not worker.server.sessions, 5), "the session was closed"
        out, stats = run(target, AsyncProposer(worker, TINY_VOCAB))
        assert out == reference and stats.worker_failures == 0
    finally:
        worker.close()


def test_the_first_block_waits_for_a_full_document_catch_up_at_the_targets_rate(target):
    # The target reads a 10-token kept prompt, the drafter the 100-token document (and, with
    # first_len=0, nothing of it yet): the first block's wait must cover reading 100 tokens at
    # the target's measured prefill cost per token of *its* prompt (1.0 s / 10 tokens).
    clock = FakeClock()
    worker = ScriptedWorker(OracleDrafter(target), ["hang"], clock=clock)
    proposer = AsyncProposer(worker, TINY_VOCAB, min_timeout=5.0, timeout_factor=10.0, clock=clock)
    kept, document = list(range(2, 12)), list(range(2, 102))
    proposer.start(kept, DecodeConfig().sampling, None, draft_prompt_ids=document, first_len=0)
    proposer.observe(Acceptance(num_accepted=0, tokens=[5]), 1.0, next_len=None)
    proposal = proposer.propose([*kept, 5])
    assert proposal.k == 0 and proposal.failed  # it hung: the request goes on alone
    # max(5, 10 x 1.0) + 3 x 100 unread x (1.0 / 10): 40 s, not the 13 s of the document's rate
    assert clock.now == pytest.approx(40.0)
