"""Sampled requests keep the target's distribution with D3D inside vLLM (chi-square).

A tiny random Llama with a 5-token vocabulary makes the exact distribution of a 3-token
continuation enumerable (the project's chi-square machinery,
:mod:`tests.engine.test_sampling_exact`). Thousands of seeded requests per mode through vLLM with
the D3D proposer must match it. On vLLM's CPU build they do because the proposer drafts nothing
for sampled requests there: vLLM's CPU verification of drafts does not keep the distribution,
which the last test shows with a proposer that always drafts the same token (when a vLLM release
fixes it, that test fails and the guard in :mod:`d3d.vllm.proposer` can go)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from d3d.config import ModelConfig, SamplingConfig
from tests.conftest import tiny_tokenizer
from tests.engine.test_sampling_exact import N_NEW, PROMPT, V, chi2_critical, chi_square
from tests.engine.test_sampling_exact import exact_distribution as exact
from tests.vllm.conftest import start

pytestmark = pytest.mark.vllm
N = 2000


def _tiny_model(root):
    """A tiny Llama vLLM's CPU kernels take (head size 64), saved with a tokenizer."""
    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=V - 1,
        bos_token_id=0,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)  # sharper distributions: drafts that often disagree
    path = root / "m"
    model.save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The tiny Llama and its folder, made once for both of this module's engines (each only
    reads them: vLLM loads the folder, the last test runs the model forward)."""
    return _tiny_model(tmp_path_factory.mktemp("tiny-vllm"))


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    """vLLM with the D3D proposer (a layer of the model as drafter, self:1) on the tiny Llama, for
    both modes: each test sends seeded requests and compares the draft counter with its own
    reading before them."""
    model, path = tiny_llama
    sock = str(tmp_path_factory.mktemp("vllm-tiny") / "stats.sock")
    served = start(
        ModelConfig(target=str(path), drafter="self:1"),
        sock,
        kv_gib=1,
        in_process=True,
        max_model_len=64,
        max_batch=256,
        skip_tokenizer_init=True,
    )
    served.worker()
    yield model, served
    served.llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sampled_requests_keep_the_target_distribution(tiny, mode):
    from vllm import SamplingParams

    model, served = tiny
    jobs = [
        (
            PROMPT,
            SamplingParams(
                max_tokens=N_NEW,
                temperature=1.0,
                seed=seed,
                ignore_eos=True,
                detokenize=False,
                extra_args={"d3d_mode": mode},
            ),
        )
        for seed in range(N)
    ]
    drafted = served.counter("vllm:spec_decode_num_draft_tokens")
    outs, _ = served.run(jobs)
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, df = chi_square(counts, exact(model, SamplingConfig(temperature=1.0)), N)
    assert stat < chi2_critical(df), (stat, df)
    assert served.counter("vllm:spec_decode_num_draft_tokens") == drafted, "none drafted on CPU"


def test_vllm_cpu_verification_of_sampled_drafts_is_not_exact(tiny_llama, tmp_path):
    """Why the proposer drafts for greedy requests only on vLLM's CPU build: a proposer that
    always drafts token 2 makes vLLM emit token 2 far more often than the target gives it."""
    from vllm import SamplingParams

    model, path = tiny_llama
    constant = {
        "method": "custom_class",
        "model": "tests.vllm.constant.ConstantProposer",
        "num_speculative_tokens": 1,
    }
    served = start(
        ModelConfig(target=str(path), drafter="none"),
        str(tmp_path / "stats.sock"),
        kv_gib=1,
        in_process=True,
        max_model_len=64,
        max_batch=256,
        skip_tokenizer_init=True,
        speculative_config=constant,
    )
    try:
        sp = SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True, detokenize=False)
        outs = served.llm.generate([{"prompt_token_ids": PROMPT}] * 1000, sp, use_tqdm=False)
    finally:
        served.llm.llm_engine.engine_core.shutdown()
    seconds = [tuple(o.outputs[0].token_ids) for o in outs]
    observed = sum(t[1] == 2 for t in seconds) / len(seconds)
    firsts = Counter(t[0] for t in seconds)  # the target's chance of 2 after each first token
    with torch.no_grad():
        expected = sum(
            n * float(torch.softmax(model(torch.tensor([[*PROMPT, t]])).logits[0, -1], -1)[2])
            for t, n in firsts.items()
        ) / len(seconds)
    # Exact verification keeps the rate within 0.04 of `expected` (three standard deviations at
    # 1,000 requests). How far above it vLLM's CPU build lands depends on load: 0.71-0.80 with
    # the test alone, 0.47-0.56 beside other work on the two cores (`make test`'s second test
    # process, or busy loops); the expected rate is about 0.2.
    assert observed > expected + 0.1, (observed, expected)
