"""Exactness on the embedded default target (SmolLM2-135M-Instruct) with real prompts.

These load the real model (about a second once converted; the first run converts the GGUF file,
about 20 s), so they are marked ``slow``; CI runs them.
"""

import json

import pytest

from d3d.config import DecodeConfig
from d3d.decoding.proposers import SyncProposer
from d3d.engine import Engine, build_drafter, decode
from d3d.model.drafter import D3DDrafter
from d3d.model.load import load_target
from tests.conftest import ScriptDrafter

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one sentence.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


@pytest.fixture(scope="module")
def target():
    return load_target("default")


@pytest.fixture(scope="module")
def reference(target) -> dict[str, list[int]]:
    """Plain greedy decoding of the target on each prompt (48 tokens), computed once."""
    engine = Engine(target, None)
    cfg = DecodeConfig(mode="ar", max_new_tokens=48)
    return {p: engine.generate(p, cfg).token_ids for p in PROMPTS}


@pytest.mark.parametrize(
    ("drafter_spec", "prompts", "n"),
    # The shipped drafter on every prompt; the self-drafters (other layers of the target, built
    # another way) on one, for 24 tokens (more than a block): what they add is how they are
    # built, not more text.
    [
        ("default", PROMPTS, 48),
        ("self:4", PROMPTS[:1], 24),
        ("self:0,7,14,21,29", PROMPTS[:1], 24),
    ],
    ids=["default", "self:4", "self:0,7,14,21,29"],
)
def test_sync_equals_ar_on_real_prompts(target, reference, drafter_spec, prompts, n):
    engine = Engine(target, build_drafter(drafter_spec, target))
    for prompt in prompts:
        sync = engine.generate(prompt, DecodeConfig(mode="sync", max_new_tokens=n))
        assert sync.token_ids == reference[prompt][:n], prompt
        text = engine.tokenizer.decode(reference[prompt][:n], skip_special_tokens=True)
        assert sync.text == text
        assert sync.stats.num_drafts > 0


def test_async_and_auto_equal_ar_with_the_drafter_in_its_own_process(reference):
    """The shipped drafter in a worker process (pinned to its own core where there are two)."""
    from d3d.config import ModelConfig

    engine = Engine.from_config(ModelConfig(), start_worker=True)
    try:
        for prompt in PROMPTS:
            ids = engine.encode(prompt)
            for mode in ("async", "auto"):
                gen = engine.generate_ids(ids, DecodeConfig(mode=mode, max_new_tokens=48))
                assert gen.token_ids == reference[prompt], (mode, prompt)
                assert gen.stats.worker_failures == 0
                if mode == "auto":  # every token after the first, speculative or plain
                    st = gen.stats
                    assert st.spec_tokens + st.ar_tokens + 1 == st.num_tokens
    finally:
        engine.close()


def test_oracle_drafter_accepts_full_blocks_on_the_real_model(target):
    engine = Engine(target, None)
    ids = engine.encode(PROMPTS[0])
    ref = engine.generate_ids(ids, DecodeConfig(mode="ar", max_new_tokens=33))
    from d3d.decoding.stats import DecodeStats

    stats = DecodeStats(mode="sync")
    cfg = DecodeConfig(mode="sync", max_new_tokens=33)
    proposer = SyncProposer(ScriptDrafter(ids, ref.token_ids))  # the known answer
    out = [
        t for c in decode(target.model, proposer, ids, cfg, target.eos_token_ids, stats) for t in c
    ]
    assert out == ref.token_ids
    assert stats.num_drafts == 2 and stats.acceptance_length == 16.0


def test_cli_sync_and_ar_print_identical_token_ids(capsys):
    """Each ``--mode`` reaches the engine and prints its JSON (``auto`` from the command line:
    ``test_cli_compare_is_what_make_demo_prints``, its figures: the test above)."""
    from d3d.cli import main

    prompt = "Write a Python function that reverses a string."
    outs = {}
    for mode in ("sync", "ar", "async"):
        assert main(["generate", prompt, "--mode", mode, "--json", "--max-new-tokens", "24"]) == 0
        outs[mode] = json.loads(capsys.readouterr().out)
    for mode in ("sync", "async"):
        assert outs[mode]["token_ids"] == outs["ar"]["token_ids"], mode
    for key in ("hit_rate", "branch_hits", "branch_misses", "branches_per_round"):
        assert key in outs["async"]
    assert (
        outs["async"]["branch_hits"] + outs["async"]["branch_misses"] == outs["async"]["num_drafts"]
    )
    for key in (
        "text",
        "token_ids",
        "mode",
        "num_tokens",
        "acceptance_length",
        "num_drafts",
        "decode_seconds",
        "spec_tokens",
        "ar_tokens",
    ):
        assert key in outs["sync"]
    assert outs["sync"]["mode"] == "sync" and outs["sync"]["num_drafts"] > 0
    assert "reverse" in outs["ar"]["text"]


def test_cli_compare_is_what_make_demo_prints(capsys):
    from d3d.cli import main

    prompt = "Write a Python function that reverses a string."
    assert main(["generate", prompt, "--compare", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "| ar | 24 |" in out and "| auto | 24 |" in out
    assert "output identical to the target alone: True" in out


def test_cli_bad_input_is_a_one_line_error(capsys):
    from d3d.cli import main

    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("d3d: error: temperature:") and err.count("\n") == 1
    assert main(["generate", "hi", "--target", "/no/such/model"]) == 2
    assert "not found" in capsys.readouterr().err


def test_drafter_from_the_real_target_shares_its_embeddings(target):
    d = D3DDrafter.from_target(target.model, 4)
    assert d.lm.get_input_embeddings() is target.model.get_input_embeddings()
    assert d.lm.get_output_embeddings() is target.model.get_output_embeddings()
