"""``async`` and ``auto`` greedy output equals plain greedy decoding; sampled ``async`` is exact.

Real D3D drafters (untrained, foreign) run in a real thread worker with branches; the oracle and
always-wrong doubles run in the scripted worker (tests/concurrency/fakes.py), which marks blocks
as hits or misses. One test runs the drafter in its own process, as on a CPU host.
"""

import pytest
import torch

from d3d.config import DecodeConfig, ModelConfig, SamplingConfig
from d3d.decoding.policy import AutoProposer, HostCosts
from d3d.decoding.proposers import ArProposer
from d3d.decoding.stats import DecodeStats
from d3d.engine import decode
from d3d.model.drafter import D3DDrafter
from d3d.worker import AsyncProposer
from tests.concurrency.fakes import ScriptedWorker
from tests.conftest import (
    TINY_VOCAB,
    OracleDrafter,
    greedy_continuation,
    tiny_model,
    tiny_tokenizer,
)
from tests.engine.test_sampling_exact import (
    V,
    chi2_critical,
    chi_square,
    exact_distribution,
    foreign_drafter,
    sample_many,
)

PROMPTS = [[1, 5, 9, 22, 7], [3] * 12, list(range(2, 40))]


def run(model, proposer, prompt, n=40, block=16, eos=frozenset()):
    stats = DecodeStats(mode=proposer.name)
    cfg = DecodeConfig(mode=proposer.name, max_new_tokens=n, block_size=block)
    out = [t for chunk in decode(model, proposer, prompt, cfg, set(eos), stats) for t in chunk]
    return out, stats


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("kind", ["untrained", "foreign"])
def test_async_and_auto_greedy_equal_ar(tiny_target, prompt, kind, thread_workers):
    source = tiny_target if kind == "untrained" else tiny_model("llama", seed=7)
    worker = thread_workers(D3DDrafter.from_target(source, 1 if kind == "untrained" else 2))
    ref, _ = run(tiny_target, ArProposer(), prompt)
    out, stats = run(tiny_target, AsyncProposer(worker, TINY_VOCAB), prompt)
    assert out == ref
    assert stats.num_tokens == len(ref) and stats.worker_failures == 0
    assert stats.branch_hits + stats.branch_misses == stats.num_drafts
    auto, astats = run(
        tiny_target, AutoProposer(AsyncProposer(worker, TINY_VOCAB), HostCosts()), prompt
    )
    assert auto == ref
    assert astats.spec_tokens + astats.ar_tokens + 1 == len(ref)  # + the prefill's token


@pytest.mark.parametrize("script", [["hit"], ["miss"], ["hit", "miss", "stale"]])
@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_and_always_wrong_drafters(tiny_target, script, wrong):
    ref, _ = run(tiny_target, ArProposer(), PROMPTS[0])
    worker = ScriptedWorker(OracleDrafter(tiny_target, wrong=wrong), script)
    out, stats = run(tiny_target, AsyncProposer(worker, TINY_VOCAB), PROMPTS[0])
    assert out == ref
    if wrong:
        assert stats.num_accepted_tokens == 0 and stats.acceptance_length == 1.0
    else:
        # 40 tokens = the prefill's token + 16 + 16 + 7 (the last round is clipped)
        assert stats.acceptance_length == 16.0 and stats.num_drafts == 3


@pytest.mark.parametrize("block", [2, 4, 8])
def test_async_block_sizes(tiny_target, block, thread_workers):
    worker = thread_workers(D3DDrafter.from_target(tiny_target, 2, block_size=block))
    ref, _ = run(tiny_target, ArProposer(), PROMPTS[0], n=30)
    out, stats = run(tiny_target, AsyncProposer(worker, TINY_VOCAB), PROMPTS[0], n=30, block=block)
    assert out == ref
    assert stats.num_draft_tokens == (block - 1) * stats.num_drafts


def test_eos_inside_a_block_and_budget_cut(tiny_target):
    ref = greedy_continuation(tiny_target, PROMPTS[2], 30)
    eos = {ref[9]}
    cut = ref[: ref.index(ref[9]) + 1]
    worker = ScriptedWorker(OracleDrafter(tiny_target), ["hit"])
    out, stats = run(tiny_target, AsyncProposer(worker, TINY_VOCAB), PROMPTS[2], n=30, eos=eos)
    assert out == cut and stats.stop_reason == "eos"
    for n in (1, 2, 7, 17):  # budgets that end before, at and inside a block
        worker = ScriptedWorker(OracleDrafter(tiny_target), ["hit"])
        out, stats = run(tiny_target, AsyncProposer(worker, TINY_VOCAB), PROMPTS[2], n=n)
        assert out == ref[:n] and stats.stop_reason == "length"


@pytest.mark.parametrize("sampling_kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_async_sampling_matches_target_distribution(sampling_kw):
    """``async`` rows, their blocks drafted by a real worker (branches while the target
    verifies, misses on receipt of the commit), emit the target's distribution."""
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    exact = exact_distribution(target, SamplingConfig(**sampling_kw))
    n = 2000
    counts = sample_many(target, "async", sampling_kw, n, drafter=foreign_drafter())
    stat, df = chi_square(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)


def test_drafter_in_its_own_process(tmp_path):
    """A saved tiny model, its drafter rebuilt from specs in a spawned, pinned process."""
    from d3d.engine import Engine
    from d3d.worker.workers import available_cores

    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs two cores")
    model = tiny_model("llama", seed=1)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    cfg = ModelConfig(
        target=str(tmp_path / "m"), drafter="self:1", drafter_device=f"cpu:{cores[-1]}"
    )
    before = torch.get_num_threads()
    engine = Engine.from_config(cfg, start_worker=True)
    try:
        worker = engine.worker()
        assert worker is not None and worker.info["kind"] == "process"
        assert worker.info["cores"] == [cores[-1]]
        prompt = PROMPTS[2]
        ref = engine.generate_ids(prompt, DecodeConfig(mode="ar", max_new_tokens=24)).token_ids
        assert set(available_cores()) == set(cores), "plain steps get every core back"
        for mode in ("async", "auto"):
            gen = engine.generate_ids(prompt, DecodeConfig(mode=mode, max_new_tokens=24))
            assert gen.token_ids == ref, mode
        engine.generate_ids(prompt, DecodeConfig(mode="async", max_new_tokens=4))
        assert cores[-1] not in available_cores(), "speculative rounds leave the drafter its core"
        # the process dies: this request finishes on the target alone; the supervisor replaces it
        first = worker.worker.pid
        worker.worker.process.kill()
        worker.worker.process.wait(5)
        gen = engine.generate_ids(prompt, DecodeConfig(mode="async", max_new_tokens=24))
        assert gen.token_ids == ref
        assert worker.wait_ready(60) and engine.worker_restarts == 1
        assert engine.worker_status()["pid"] not in (None, first)
        stats = engine.generate_ids(prompt, DecodeConfig(mode="async", max_new_tokens=24))
        assert stats.token_ids == ref and stats.stats.branch_misses + stats.stats.branch_hits > 0
    finally:
        engine.close()
    assert torch.get_num_threads() == before, "closing the engine gives the cores back"
