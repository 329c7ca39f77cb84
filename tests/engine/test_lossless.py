"""Every decoding mode's greedy output equals plain greedy decoding of the target.

Tiny random-weight Llama and Qwen3 targets, with three drafters: an untrained D3D drafter built
from the target's layers, one that is always wrong, and an oracle that drafts the target's own
continuation (acceptance length must then be the full block, 16 tokens per round).
"""

import pytest
import torch

from d3d.config import DecodeConfig
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.decoding.stats import DecodeStats
from d3d.engine import decode
from d3d.model.drafter import D3DDrafter
from tests.conftest import OracleDrafter, greedy_continuation, tiny_model

PROMPTS = [[1, 5, 9, 22, 7], [3] * 12, list(range(2, 40))]
NO_EOS: set[int] = set()


def run(model, proposer, prompt, n=40, block=16, eos=NO_EOS):
    stats = DecodeStats(mode=proposer.name)
    cfg = DecodeConfig(mode=proposer.name, max_new_tokens=n, block_size=block)
    out = [t for chunk in decode(model, proposer, prompt, cfg, eos, stats) for t in chunk]
    return out, stats


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ar_equals_naive_greedy(tiny_target, prompt):
    out, stats = run(tiny_target, ArProposer(), prompt, n=20)
    assert out == greedy_continuation(tiny_target, prompt, 20)
    assert stats.num_tokens == 20 and stats.stop_reason == "length"


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("drafter_kind", ["untrained", "wrong", "oracle", "foreign"])
def test_sync_greedy_equals_ar_greedy(tiny_target, prompt, drafter_kind):
    if drafter_kind == "untrained":
        drafter = D3DDrafter.from_target(tiny_target, 1)
    elif drafter_kind == "foreign":  # another model's weights entirely (shared vocabulary only)
        other = tiny_model("llama", seed=7)
        drafter = D3DDrafter.from_target(other, 2)
    else:
        drafter = OracleDrafter(tiny_target, wrong=drafter_kind == "wrong")
    ref, _ = run(tiny_target, ArProposer(), prompt)
    out, stats = run(tiny_target, SyncProposer(drafter), prompt)
    assert out == ref
    assert stats.num_tokens == len(ref)
    if drafter_kind == "wrong":
        assert stats.num_accepted_tokens == 0
        assert stats.acceptance_length == 1.0
    if drafter_kind == "oracle":
        # 40 tokens = the prefill's first token + 16 + 16 + 7 (the last round is clipped).
        assert stats.accepted_per_position[0] == stats.num_drafts
        assert stats.num_accepted_tokens == 15 * stats.num_drafts
        assert stats.acceptance_length == 16.0


@pytest.mark.parametrize("block", [2, 4, 8])
def test_sync_block_sizes(tiny_target, block):
    drafter = D3DDrafter.from_target(tiny_target, 2, block_size=block)
    ref, _ = run(tiny_target, ArProposer(), PROMPTS[0], n=30)
    out, stats = run(tiny_target, SyncProposer(drafter), PROMPTS[0], n=30, block=block)
    assert out == ref
    assert stats.num_draft_tokens == (block - 1) * stats.num_drafts
    oracle, ostats = run(
        tiny_target, SyncProposer(OracleDrafter(tiny_target, block)), PROMPTS[0], n=30, block=block
    )
    assert oracle == ref and ostats.acceptance_length == block


def test_stops_at_eos_in_the_middle_of_an_accepted_block(tiny_target):
    ref = greedy_continuation(tiny_target, PROMPTS[2], 30)
    eos = {ref[9]}
    cut = ref[: ref.index(ref[9]) + 1]
    for proposer in (ArProposer(), SyncProposer(OracleDrafter(tiny_target))):
        out, stats = run(tiny_target, proposer, PROMPTS[2], n=30, eos=eos)
        assert out == cut, proposer.name
        assert stats.stop_reason == "eos"


def test_drafter_cache_holds_committed_tokens_only(tiny_target):
    drafter = D3DDrafter.from_target(tiny_target, 2)
    session = drafter.session()
    a = session.draft([4, 5, 6, 7])
    assert session.cache.get_seq_length() == 3  # everything but the anchor; no block KV left
    session.draft([4, 5, 6, 7, 8, 9])
    assert session.cache.get_seq_length() == 5
    b = session.draft([4, 5, 6, 7])  # a shorter, diverging sequence rolls the cache back
    assert session.cache.get_seq_length() == 3
    assert torch.equal(a.tokens, b.tokens)
    fresh = drafter.session().draft([4, 5, 6, 7])
    assert torch.equal(fresh.tokens, a.tokens)


def test_block_forward_matches_a_cacheless_reference(tiny_target):
    """The cached block forward equals one full forward of [prefix, anchor, masks] with a hand mask."""
    drafter = D3DDrafter.from_target(tiny_target, 2, block_size=4)
    prefix, anchor = [3, 8, 13, 21], 34
    logits = drafter.block_logits(anchor, _cache_with(drafter, prefix))
    s = len(prefix)
    emb = drafter.lm.get_input_embeddings()(torch.tensor([prefix]))
    x = torch.cat([emb, drafter.block_embeds(torch.tensor([anchor]))], dim=1)
    mask = torch.ones(1, 1, s + 4, s + 4, dtype=torch.bool).tril()
    mask[0, 0, s:, s:] = True  # the block is bidirectional within itself
    with torch.inference_mode():
        ref = drafter.lm(
            inputs_embeds=x, attention_mask=mask, position_ids=torch.arange(s + 4)[None]
        ).logits
    torch.testing.assert_close(logits, ref[0, s : s + 3], atol=1e-5, rtol=1e-4)


def test_fused_catch_up_and_block_equals_encode_then_block(tiny_target):
    drafter = D3DDrafter.from_target(tiny_target, 2)
    ref = drafter.block_logits(34, _cache_with(drafter, [3, 8, 13, 21, 5, 6]))
    cache = _cache_with(drafter, [3, 8, 13])
    with torch.inference_mode():
        fused = drafter.block_logits(34, cache, pending=[21, 5, 6])
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 6, "pending tokens stay cached, the block does not"


def _cache_with(drafter, prefix):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        drafter.encode(prefix, cache)
    return cache


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_prefix_from_the_prefix_cache_gives_plain_greedy_decoding(tiny_target, prompt):
    """The target's KV for a shared prompt prefix, stored by one request and taken by the
    next, decodes exactly as plain greedy decoding of the whole prompt."""
    from d3d.engine.kv_store import PrefixCache

    cache = PrefixCache()
    cfg = DecodeConfig(mode="ar", max_new_tokens=20)
    want = greedy_continuation(tiny_target, prompt, 20)
    shared = len(prompt) // 2
    for reused in (0, shared):
        stats = DecodeStats(mode="ar")
        out = decode(tiny_target, ArProposer(), prompt, cfg, NO_EOS, stats, None, shared, cache)
        assert [t for chunk in out for t in chunk] == want
        assert stats.cached_prompt_tokens == reused
    assert len(cache) == 1 and cache.stats()["hits"] == 1


def test_the_prefill_round_prices_a_cached_prefix_like_the_rest(tiny_target):
    """Round 0 tells proposers the whole prompt's prefill, the cached prefix priced at the rate
    of the tokens encoded, so a cost per prompt token read from it does not fall with the
    cache (auto's catch-up rule prices the drafter's reading with it)."""
    from d3d.engine.kv_store import PrefixCache

    class Recording(ArProposer):
        def observe(self, acc, verify_s, next_len=None):
            self.seen = [*getattr(self, "seen", []), verify_s]

    prompt, cache = list(range(2, 42)), PrefixCache()
    cfg = DecodeConfig(mode="ar", max_new_tokens=3)
    for reused in (0, 30):
        stats, proposer = DecodeStats(mode="ar"), Recording()
        list(decode(tiny_target, proposer, prompt, cfg, NO_EOS, stats, None, 30, cache))
        assert stats.cached_prompt_tokens == reused
        scale = len(prompt) / (len(prompt) - reused)
        assert proposer.seen[0] == pytest.approx(stats.prefill_seconds * scale, rel=1e-3, abs=1e-4)
