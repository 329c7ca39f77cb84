"""The packed branch forward drafts exactly what drafting each outcome on its own would.

One forward encodes the chain ``[a, d_1..d_K]`` and drafts a block per outcome (k, r); each
block must equal the block the synchronous path drafts after committing ``a, d_1..d_k, r`` —
the 4D mask and positions are what makes that true. Also: the server's hits and misses.
"""

import pytest
import torch
from transformers import DynamicCache

from d3d.config import SamplingConfig
from d3d.model.drafter import D3DDrafter
from d3d.worker.drafting import draft_branches, encode_chain
from d3d.worker.protocol import Block, Close, Commit, Open
from d3d.worker.server import DraftServer, ServerConfig
from tests.conftest import tiny_model


def _cache_with(drafter, ids):
    cache = DynamicCache()
    with torch.inference_mode():
        drafter.encode(ids, cache)
    return cache


def test_each_branch_equals_drafting_that_outcome_alone():
    target = tiny_model("qwen3", seed=2)
    drafter = D3DDrafter.from_target(target, 2, block_size=5)
    prefix, anchor, drafts = [3, 8, 13, 21], 34, [40, 41, 42, 43]
    cache = _cache_with(drafter, prefix)
    causal = encode_chain(drafter, cache, [anchor, *drafts])
    assert causal.shape == (5, target.config.vocab_size)
    assert cache.get_seq_length() == len(prefix) + 5
    outcomes = [(0, 7), (2, 9), (4, 11)]  # (k accepted, then r)
    n0 = len(prefix) + 1
    branches = draft_branches(
        drafter, cache, [n0 + k for k, _ in outcomes], [r for _, r in outcomes]
    )
    assert branches.shape == (3, 4, target.config.vocab_size)
    assert cache.get_seq_length() == len(prefix) + 5, "branch blocks leave no KV behind"
    for (k, r), got in zip(outcomes, branches, strict=True):
        ref_cache = _cache_with(drafter, [*prefix, anchor, *drafts[:k]])
        with torch.inference_mode():
            ref = drafter.block_scores(r, ref_cache)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # the chain's causal scores are the drafter's next-token logits at each chain position
    with torch.inference_mode():
        full = drafter.lm(torch.tensor([[*prefix, anchor, *drafts]])).logits[0, len(prefix) :]
    torch.testing.assert_close(causal, full, atol=1e-4, rtol=1e-4)


def _run(server, msgs):
    out = []
    for m in msgs:
        out += list(server.handle(m))
    return out


def test_server_hit_serves_the_prepared_branch_and_miss_drafts_now():
    target = tiny_model("llama", seed=1)
    drafter = D3DDrafter.from_target(target, 1, block_size=4)
    server = DraftServer(drafter, ServerConfig(max_branches=6))
    greedy = SamplingConfig()
    _run(server, [Open(1, [5, 6, 7, 8], greedy, 0)])
    sess = server.sessions[1]
    assert sess.branches, "branches for the first token are prepared during the prefill"
    (pos, k, r), prepared = next(iter(sess.branches.items()))
    assert (pos, k) == (4, 0)
    [blk] = _run(server, [Commit(1, [r], 0.1)])
    assert isinstance(blk, Block) and blk.hit is True and blk.pos == 5
    assert blk.tokens == prepared.tokens
    # the same block, drafted the synchronous way
    with torch.inference_mode():
        ref = drafter.block_scores(r, _cache_with(drafter, [5, 6, 7, 8]))
    assert blk.tokens == ref.argmax(-1).tolist()
    # a token no branch expected: a miss, drafted at once, still correct
    keys = set(server.sessions[1].branches)
    miss_r = next(t for t in range(100) if (5, 0, t) not in keys)
    [blk2] = _run(server, [Commit(1, [miss_r], 0.1)])
    assert blk2.hit is False and blk2.pos == 6
    with torch.inference_mode():
        ref2 = drafter.block_scores(miss_r, _cache_with(drafter, [5, 6, 7, 8, r]))
    assert blk2.tokens == ref2.argmax(-1).tolist()
    _run(server, [Close(1)])
    assert not server.sessions


def test_reading_a_prompt_is_no_sample_of_the_branch_cost():
    """The budget fits ``t(n) = a + b n`` to branch rounds. A prepare that first reads a prompt
    (or the catch-up after plain steps) grows with those tokens instead; counted, one long
    prompt read made branches look as dear as a verify, and none was drafted for many rounds."""
    target = tiny_model("llama", seed=1)
    drafter = D3DDrafter.from_target(target, 1, block_size=4)
    ticks = iter(range(10_000))
    server = DraftServer(drafter, ServerConfig(max_branches=6), clock=lambda: float(next(ticks)))
    _run(server, [Open(1, [5, 6, 7, 8], SamplingConfig(), 0)])
    assert server.sessions[1].branches, "branches for the first token, prompt read"
    assert not server.budget.cost.samples
    (_, _, r), _ = next(iter(server.sessions[1].branches.items()))
    [blk] = _run(server, [Commit(1, [r], 0.1)])
    assert blk.hit is True
    assert len(server.budget.cost.samples) == 1, "a round with nothing to read is a sample"


def test_plain_steps_leave_the_drafter_idle_until_a_block_is_wanted():
    """A lazy Open and commits for plain steps run no forward; the first wanted block reads
    everything pending in its own forward and equals drafting from a cache kept up to date."""
    target = tiny_model("llama", seed=1)
    drafter = D3DDrafter.from_target(target, 1, block_size=4)
    server = DraftServer(drafter)
    calls = []
    drafter.encode = lambda *a, **k: calls.append(a)  # would be the per-step catch-up
    _run(server, [Open(1, [5, 6, 7], SamplingConfig(), 0, prepare=False)])
    assert _run(server, [Commit(1, [9], 0.01, 0), Commit(1, [10], 0.01, 0)]) == []
    assert calls == [] and server.sessions[1].cached_ids == [] and not server.sessions[1].branches
    del drafter.encode
    [blk] = _run(server, [Commit(1, [11], 0.01)])
    assert blk.hit is False and blk.pos == 6
    with torch.inference_mode():
        ref = drafter.block_scores(11, _cache_with(drafter, [5, 6, 7, 9, 10]))
    assert blk.tokens == ref.argmax(-1).tolist()


def test_sampled_blocks_carry_their_sparse_q():
    target = tiny_model("llama", seed=1)
    drafter = D3DDrafter.from_target(target, 1, block_size=4)
    server = DraftServer(drafter, ServerConfig(q_top=8))
    sampling = SamplingConfig(temperature=1.0, seed=3)
    _run(server, [Open(1, [5, 6, 7], sampling, 3)])
    [blk] = _run(server, [Commit(1, [9], 0.01)])
    assert blk.q_ids.shape == (3, 8) and blk.q_probs.shape == (3, 8)
    assert abs(blk.q_probs.sum(1) - 1).max() < 1e-5
    for tok, ids in zip(blk.tokens, blk.q_ids, strict=True):
        assert tok in ids.tolist(), "each draft token was sampled from its slot's q"


def test_chain_and_branches_in_one_forward_equal_the_two_step_way():
    target = tiny_model("llama", seed=4)
    drafter = D3DDrafter.from_target(target, 2, block_size=4)
    prefix, anchor, drafts = [3, 8, 13, 21], 34, [40, 41, 42]
    outcomes = [(0, 7), (2, 9)]  # the chain needs a, d_1, d_2
    n0 = len(prefix) + 1
    visible = [n0 + k for k, _ in outcomes]
    cache = _cache_with(drafter, prefix)
    fused = draft_branches(
        drafter, cache, visible, [r for _, r in outcomes], chain=[anchor, *drafts[:2]]
    )
    assert cache.get_seq_length() == len(prefix) + 3, "the chain stays cached, no block does"
    ref_cache = _cache_with(drafter, [*prefix, anchor, *drafts[:2]])
    ref = draft_branches(drafter, ref_cache, visible, [r for _, r in outcomes])
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("adapter", [False, True])
def test_blocks_of_several_sessions_in_one_forward_equal_drafting_each_alone(kind, adapter):
    """A step's missed blocks, drafted for every session at once (sessions at different
    lengths, with and without pending tokens to read first), give the scores and leave the caches
    exactly as one block_scores call per session does."""
    from d3d.model.adapters import AdapterConfig
    from d3d.worker.drafting import draft_blocks

    target = tiny_model(kind, seed=2, layers=3, scale=2.0)
    d = D3DDrafter.from_target(
        target, 3, block_size=5, adapter=AdapterConfig(rank=4) if adapter else None
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad or adapter is False:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    prompts = [list(range(3, 30)), list(range(40, 48)), [9] * 3]
    pending = [[5, 6, 7], [], [11]]
    anchors = [12, 13, 14]

    def caches():
        out = []
        for p in prompts:
            c = DynamicCache()
            d.encode(p, c)
            out.append(c)
        return out

    alone_caches, batch_caches = caches(), caches()
    alone = [
        d.block_scores(a, c, pend)
        for c, pend, a in zip(alone_caches, pending, anchors, strict=True)
    ]
    batched = draft_blocks(d, list(zip(batch_caches, pending, anchors, strict=True)))
    for x, y in zip(alone, batched, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    for c1, c2 in zip(alone_caches, batch_caches, strict=True):
        assert c1.get_seq_length() == c2.get_seq_length()
        for l1, l2 in zip(c1.layers, c2.layers, strict=True):
            torch.testing.assert_close(l1.keys, l2.keys, atol=1e-5, rtol=1e-5)


def test_a_steps_hits_go_out_before_its_misses_are_drafted():
    """One step's commits: the row whose branch was prepared gets its block before the worker
    drafts the missed rows' blocks (the target waits for every block of the step)."""
    from d3d.worker.protocol import Commits

    target = tiny_model("llama", seed=1)
    drafter = D3DDrafter.from_target(target, 1, block_size=4)
    server = DraftServer(drafter, ServerConfig(max_branches=6))
    greedy = SamplingConfig()
    _run(server, [Open(1, [5, 6, 7, 8], greedy, 0), Open(2, [9, 10, 11], greedy, 0)])
    (_, _, hit_r), _ = next(iter(server.sessions[1].branches.items()))
    keys = set(server.sessions[2].branches)
    miss_r = next(t for t in range(100) if (3, 0, t) not in keys)
    order: list[str] = []
    real = server._draft_many

    def drafting(sessions):
        order.append("draft")
        return real(sessions)

    server._draft_many = drafting
    for reply in server.handle(Commits([Commit(2, [miss_r], 0.1), Commit(1, [hit_r], 0.1)])):
        if isinstance(reply, Block):
            order.append(f"block {reply.sid} {'hit' if reply.hit else 'miss'}")
    assert order[:3] == ["block 1 hit", "draft", "block 2 miss"]
