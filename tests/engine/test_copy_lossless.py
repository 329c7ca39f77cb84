"""``auto`` with copy rounds (drafts copied from the request's own text) stays lossless.

Greedy: the output equals plain greedy decoding on tiny Llama and Qwen3 targets, with prompts
that make copies both right (the target's own continuation written earlier in the prompt) and
wrong (unrelated repeats); copies are forced at every match so both cases are exercised.
Sampling: one-hot q makes the exact acceptance rule reproduce the target's distribution
(chi-square over 2,000 seeds, as for the drafter's modes).
"""

import pytest

from d3d.config import SamplingConfig
from d3d.decoding.lookup import CopyCosts, CopyDrafts
from d3d.decoding.policy import AutoProposer, HostCosts
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.model.drafter import D3DDrafter
from tests.conftest import TINY_VOCAB, greedy_continuation, tiny_model
from tests.engine.test_async_lossless import run
from tests.engine.test_sampling_exact import (
    V,
    chi2_critical,
    chi_square,
    exact_distribution,
    sample_many,
)


def losing_drafter_host() -> HostCosts:
    """Host figures that keep the drafter off: only copies and plain steps run."""
    host = HostCosts()
    host.step_s.add(0.01)
    host.per_token_s.add(0.01)
    host.wait_s.add(1.0)
    host.accept.update(15, 0)
    host.probe_interval = 10**6
    return host


def copying_auto(target, vocab: int, block: int = 16, drafter: bool = True) -> AutoProposer:
    """auto with a drafter that never pays (``drafter=False``: none at all, which is cheaper
    per request) and copies verified at every match (a
    losing one at its best length)."""
    copies = CopyDrafts(CopyCosts(), max_len=block - 1, vocab_size=vocab, retry_every=1)
    spec = (
        SyncProposer(D3DDrafter.from_target(target, 1, block_size=block))
        if drafter
        else ArProposer()
    )
    return AutoProposer(spec, losing_drafter_host(), max_len=block - 1, copies=copies)


def copy_rounds(target):
    """A new :func:`copying_auto` per row (no drafter, blocks of 4) for :func:`sample_many`."""
    return lambda: copying_auto(target, V, block=4, drafter=False)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_copy_rounds_greedy_equal_ar(kind):
    target = tiny_model(kind, seed=1)
    head = [4, 17, 23, 8, 61, 2]
    own = greedy_continuation(target, head, 24)
    prompts = [
        head + own + [9] + head,  # the target's continuation of `head` is in the prompt
        [3, 5] * 10,  # repeats whose copies the target mostly rejects
        list(range(2, 40)) + list(range(2, 12)),
    ]
    accepted = 0
    for prompt in prompts:
        ref, _ = run(target, ArProposer(), prompt)
        out, stats = run(target, copying_auto(target, TINY_VOCAB), prompt)
        assert out == ref
        assert stats.copy_drafts > 0
        assert stats.spec_tokens + stats.ar_tokens + 1 == len(ref)
        accepted += stats.copy_accepted_tokens
    assert accepted > 0  # some copies were right, so acceptance was exercised too


def test_copy_rounds_respect_eos_and_the_budget():
    target = tiny_model("llama", seed=1)
    prompt = [4, 17, 23, 8, 61, 2]
    ref = greedy_continuation(target, prompt, 30)
    prompt = prompt + ref + [9] + prompt
    ref = greedy_continuation(target, prompt, 30)
    for n in (1, 2, 7, 17):
        out, stats = run(target, copying_auto(target, TINY_VOCAB), prompt, n=n)
        assert out == ref[:n] and stats.stop_reason == "length"
    eos = {ref[5]}
    out, stats = run(target, copying_auto(target, TINY_VOCAB), prompt, n=30, eos=eos)
    assert out == ref[: ref.index(ref[5]) + 1] and stats.stop_reason == "eos"


@pytest.mark.parametrize("sampling_kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_copy_sampling_matches_target_distribution(sampling_kw):
    """Copy rounds (one-hot q) emit the target's distribution; a 5-token vocabulary gives
    every step an earlier match to copy from."""
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    exact = exact_distribution(target, SamplingConfig(**sampling_kw))
    n = 2000
    counts = sample_many(target, "auto", sampling_kw, n, proposer=copy_rounds(target))
    stat, df = chi_square(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)
