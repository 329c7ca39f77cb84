"""D3D inside vLLM (its CPU build, the embedded SmolLM2-135M and its shipped drafter): greedy
answers in ``sync``, ``async`` and ``auto`` equal vLLM without drafts (``ar``) token for token,
one request at a time and eight at once with mixed modes, prompts of different lengths and
requests joining mid-flight; vLLM's own acceptance counters grow; ``async`` requests report
branch hits; the drafter process killed with SIGKILL under eight requests costs no answer and
is replaced; steps in which no row drafts take vLLM's plain path. (That vLLM's engine core
fetches no drafts after them is a matter between its processes: tests/vllm/test_vllm_service.py
checks it on the engine as the product starts it.)"""

from __future__ import annotations

import os
import signal

import pytest

from d3d.model.load import encode_prompt, load_target

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

QUESTIONS = [
    "List the days of the week.",
    "Write a Python function that reverses a string.",
    "Count from one to twenty in words: one, two, three,",
    "Repeat after me: the quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog. " * 6,
    "What is the capital of France?",
    "Name three colours.",
    "Explain what a list is in Python, in two sentences.",
    "Spell the word 'banana' letter by letter.",
]
NEW = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = load_target("default").tokenizer
    return [encode_prompt(tok, q, True) for q in QUESTIONS]


def params(mode: str, n: int = NEW):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, extra_args={"d3d_mode": mode})


@pytest.fixture(scope="module")
def reference(embedded, prompts) -> list[list[int]]:
    """vLLM without drafts, one request at a time."""
    return [embedded.run([(p, params("ar"))])[0][0] for p in prompts]


def test_every_mode_equals_ar_one_request_at_a_time(embedded, prompts, reference):
    before = embedded.counter("vllm:spec_decode_num_accepted_tokens")
    for mode in ("sync", "async", "auto"):
        for p, ref in zip(prompts[:4], reference, strict=False):
            (out,), (rid,) = embedded.run([(p, params(mode))])
            assert out == ref, mode
            st = embedded.stats.ask("request", rid)
            assert st is not None and st["mode"] == mode
    assert embedded.counter("vllm:spec_decode_num_accepted_tokens") > before


def test_eight_requests_mixed_modes_joining_mid_flight_equal_ar(embedded, prompts, reference):
    modes = ["async", "sync", "auto", "ar"] * 2
    jobs = [(p, params(m)) for p, m in zip(prompts, modes, strict=True)]
    outs, rids = embedded.run(jobs, join=[0, 0, 1, 2, 3, 5, 8, 13])
    assert outs == reference
    hits = [embedded.stats.ask("request", r) for r, m in zip(rids, modes, strict=True)]
    async_hits = sum(s["branch_hits"] for s, m in zip(hits, modes, strict=True) if m == "async")
    assert async_hits > 0, "async requests are served from branches prepared during verification"


def test_the_drafter_killed_under_eight_requests_costs_no_answer(embedded, prompts, reference):
    first = embedded.worker()
    jobs = [(p, params("async", NEW)) for p in prompts]
    engine = embedded.llm.llm_engine
    rids = [f"kill{i}" for i in range(len(jobs))]
    for rid, (p, sp) in zip(rids, jobs, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    out: dict[str, list[int]] = {}
    steps = 0
    while len(out) < len(jobs):
        if steps == 3:
            os.kill(first["pid"], signal.SIGKILL)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
    assert [out[r] for r in rids] == reference, "every request answered, as without drafts"
    again = embedded.worker(timeout=60, restarts=first["restarts"] + 1)
    assert again["pid"] != first["pid"]
    (outs, (rid,)) = embedded.run([(prompts[3], params("async"))])
    assert outs == [reference[3]]
    st = embedded.stats.ask("request", rid)
    assert st["branch_hits"] + st["branch_misses"] > 0, "the new worker drafts again"


def test_steps_without_drafts_take_vllms_plain_path(embedded, prompts, reference):
    before = embedded.stats.ask("totals")
    (out,), _ = embedded.run([(prompts[0], params("ar"))])
    assert out == reference[0]
    mid = embedded.stats.ask("totals")
    assert mid["plain_steps"] - before["plain_steps"] >= NEW, "each step of an ar request"
    assert mid["speculative_steps"] == before["speculative_steps"]
    (out,), _ = embedded.run([(prompts[3], params("sync"))])
    assert out == reference[3]
    after = embedded.stats.ask("totals")
    assert after["speculative_steps"] > mid["speculative_steps"]
