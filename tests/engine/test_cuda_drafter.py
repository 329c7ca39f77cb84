"""The cuda backend's packed drafter, run on the CPU (everything but the capture): its blocks and
branches equal the row-by-row drafter's (``block_scores``, ``draft_branches``) for rows of
different lengths and several branch counts, its slot KV after many appends equals a fresh
forward over the whole prefix, the on-device branch choice equals the host's, its server
answers every message as the row-by-row server does, and every mode decodes through it exactly
as ``ar`` does. On a GPU the captured steps give the eager steps' scores."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from d3d.backends.cuda import CudaBackend
from d3d.backends.cuda.drafter import PackedDrafter, PackedPlan, plan_of
from d3d.backends.cuda.fused import joined
from d3d.backends.cuda.rehearsal import GraphHazard, Rehearsal
from d3d.config import SamplingConfig
from d3d.engine import GenRequest
from d3d.model.adapters import AdapterConfig
from d3d.model.drafter import D3DDrafter
from d3d.worker.branches import choose_branches, choose_rows
from d3d.worker.drafting import draft_branches
from d3d.worker.packed import PackedDraftServer
from d3d.worker.proposer import AsyncProposer
from d3d.worker.protocol import Block, Commit, Commits, Failed, Open
from d3d.worker.server import DraftServer, ServerConfig
from d3d.worker.workers import server_for
from tests.conftest import TINY_VOCAB, greedy_continuation, tiny_engine, tiny_model

BK = 5  # block size of the tiny drafters: K = 4 drafts


def drafter_of(kind: str) -> D3DDrafter:
    """A tiny random drafter: plain, with gated adapters (non-zero, so the gate matters), or
    with a draft vocabulary."""
    target = tiny_model("qwen3" if kind != "llama" else "llama", seed=2)
    adapter = AdapterConfig(rank=4) if kind == "adapters" else None
    d = D3DDrafter.from_target(target, 2, block_size=BK, adapter=adapter)
    if kind == "adapters":
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for lora in d.adapters.lora.values():
                lora.B.copy_(torch.randn(lora.B.shape, generator=gen) * 0.5)
    if kind == "vocab":
        d.set_draft_vocab(torch.arange(0, TINY_VOCAB, 3))
    return d


def cache_of(d: D3DDrafter, ids: list[int]) -> DynamicCache:
    cache = DynamicCache()
    with torch.inference_mode():
        d.encode(ids, cache)
    return cache


def packed(d: D3DDrafter, rows: int = 4) -> PackedDrafter:
    return PackedDrafter(d, PackedPlan(graphs=False, rows=rows, kv_tokens=rows * 512))


PREFIXES = [[3, 8, 13, 21, 5, 6], [(5 * i) % 90 + 2 for i in range(40)], [7, 9], [11] * 13]
NONE = torch.zeros(len(PREFIXES), 0, dtype=torch.long)


def test_on_device_choice_equals_the_host_choice():
    gen = torch.Generator().manual_seed(0)
    k, v = 6, 40
    for cover in (False, True):
        for n in (1, 3, 8, 30):
            verified = torch.tensor([6, 0, 3, 6, 2])
            drafts = torch.randint(v, (5, k), generator=gen)
            logits = torch.randn(5, k, v, generator=gen) * 3
            dist = torch.softmax(logits, -1)
            dist = torch.cat([dist, dist.new_zeros(5, 1, v)], 1)
            dist = dist * (torch.arange(k + 1)[None] <= verified[:, None])[:, :, None]
            got = choose_rows(drafts, dist, verified, n, cover)
            for i in range(5):
                m = int(verified[i])
                row = dist[i, : m + 1] if m < k else dist[i]
                want = choose_branches(drafts[i, :m], row, n, cover)
                want = {(o.k, o.r) for o in want if o.p > 0}
                real = got.logp[i] > float("-inf")
                pairs = set(zip(got.k[i][real].tolist(), got.r[i][real].tolist(), strict=True))
                assert pairs == want, (cover, n, i)


@pytest.mark.parametrize("kind", ["llama", "plain", "adapters", "vocab"])
def test_blocks_equal_the_row_by_row_blocks(kind):
    d = drafter_of(kind)
    p = packed(d)
    rows = [p.open(100) for _ in PREFIXES]
    # rows read their prompts but the last 0-3 tokens (a long chain: the eager step)
    lag = [0, 3, 1, 2]
    p.run(rows, [x[: -1 - g] for x, g in zip(PREFIXES, lag, strict=True)], NONE, NONE)
    assert p.counts == {"packed": 0, "eager": 1}
    pending = [x[len(x) - 1 - g : -1] for x, g in zip(PREFIXES, lag, strict=True)]
    visible = torch.tensor([[len(x) - 1] for x in PREFIXES])
    anchors = torch.tensor([[x[-1]] for x in PREFIXES])
    out = p.run(rows, pending, visible, anchors)  # chains of 0-3 tokens: the captured form
    assert p.counts == {"packed": 1, "eager": 1}
    assert [r.length for r in rows] == [len(x) - 1 for x in PREFIXES]
    for i, (x, g) in enumerate(zip(PREFIXES, lag, strict=True)):
        cache = cache_of(d, x[: -1 - g])
        with torch.inference_mode():
            want = d.block_scores(x[-1], cache, pending[i])
        torch.testing.assert_close(out.blocks[i, 0], want, atol=1e-5, rtol=1e-5)
        assert out.blocks[i, 0].argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["plain", "adapters"])
@pytest.mark.parametrize("n", [1, 3, 6])
def test_branches_equal_draft_branches(kind, n):
    d = drafter_of(kind)
    p = packed(d)
    rows = [p.open(100) for _ in PREFIXES]
    p.run(rows, [x[:-1] for x in PREFIXES], NONE, NONE)
    gen = torch.Generator().manual_seed(n)
    chains, visible, anchors = [], [], []
    for x in PREFIXES:  # the anchor and K drafts read; branch b accepts k_b of them
        chains.append([x[-1], *torch.randint(TINY_VOCAB, (BK - 1,), generator=gen).tolist()])
        ks = torch.randint(BK, (n,), generator=gen).tolist()
        visible.append([len(x) + k for k in ks])
        anchors.append(torch.randint(TINY_VOCAB, (n,), generator=gen).tolist())
    out = p.run(rows, chains, torch.tensor(visible), torch.tensor(anchors))
    assert out.blocks.shape[:3] == (len(PREFIXES), n, BK - 1)
    for i, x in enumerate(PREFIXES):
        cache = cache_of(d, x[:-1])
        want = draft_branches(d, cache, visible[i], anchors[i], chains[i])
        torch.testing.assert_close(out.blocks[i], want, atol=1e-5, rtol=1e-5)
        assert out.blocks[i].argmax(-1).tolist() == want.argmax(-1).tolist()
        assert rows[i].length == len(x) + BK - 1  # the chain is kept, the blocks are not


@pytest.mark.parametrize("kind", ["plain", "adapters"])
def test_appends_over_many_steps_equal_a_fresh_forward(kind):
    d = drafter_of(kind)
    p = packed(d)
    rows = [p.open(200) for _ in PREFIXES]
    seqs = [list(x) for x in PREFIXES]
    p.run(rows, seqs, NONE, NONE)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):  # chains of 0..K+1 tokens, with branch blocks written after them
        chains = [torch.randint(TINY_VOCAB, (int(c),), generator=gen).tolist()
                  for c in torch.randint(BK + 1, (len(rows),), generator=gen)]  # fmt: skip
        vis = torch.tensor([[len(s)] * 2 for s in seqs])
        p.run(rows, chains, vis, torch.full((len(rows), 2), 7))
        for s, c in zip(seqs, chains, strict=True):
            s += c
        if step == 3:  # cut a row back, as a commit that accepted less than its chain does
            rows[0].length -= 2
            del seqs[0][-2:]
    for row, s in zip(rows, seqs, strict=True):
        assert row.length == len(s)
        cache = cache_of(d, s)
        for layer, lay in enumerate(cache.layers):
            got = p.kv.keys[layer][row.slot, :, : len(s)]
            torch.testing.assert_close(got, lay.keys[0], atol=1e-5, rtol=1e-5)
            got = p.kv.values[layer][row.slot, :, : len(s)]
            torch.testing.assert_close(got, lay.values[0], atol=1e-5, rtol=1e-5)


def drive(server, sessions: int, steps: int, sampling: SamplingConfig) -> list:
    """Every session through ``steps`` rounds: odd rounds commit the most likely prepared
    outcome (a hit), even ones an outcome nobody prepared (a miss); the replies, in order."""
    replies = []
    for sid in range(1, sessions + 1):
        prompt = [(3 * sid + j) % 90 + 2 for j in range(4 + 5 * sid)]
        replies += list(server.handle(Open(sid, prompt, sampling, seed=sid)))
    last: dict[int, list[int]] = {}
    for step in range(steps):
        items = []
        for sid in range(1, sessions + 1):
            sess = server.sessions[sid]
            keys = sorted(sess.branches)
            if step % 2 and keys:
                _, k, r = keys[len(keys) // 2]
            else:
                k, r = step % BK, 97
            tokens = [*last.get(sid, [])[:k], r]
            if sid not in last:  # the first round follows the prefill: just the first token
                tokens = [r]
            items.append(Commit(sid, tokens, 0.1, next_len=None if step % 3 else 2))
        out = list(server.handle(Commits(items)))
        for b in out:
            assert isinstance(b, Block), b
            last[b.sid] = b.tokens
        replies += out
    return [(b.sid, b.pos, b.tokens, b.hit) for b in replies]


@pytest.mark.parametrize("kind", ["plain", "adapters"])
@pytest.mark.parametrize("cover", [False, True])
def test_the_packed_server_answers_as_the_row_by_row_server(kind, cover):
    d = drafter_of(kind)
    cfg = ServerConfig(fixed_branches=3, cover=cover)
    plan = PackedPlan(graphs=False, rows=4, kv_tokens=4 * 512)
    want = drive(DraftServer(d, cfg), 3, 8, SamplingConfig())
    server = PackedDraftServer(d, cfg, plan=plan)
    got = drive(server, 3, 8, SamplingConfig())
    assert got == want
    assert any(hit for *_, hit in got) and not all(hit for *_, hit in got)
    assert server.packed.counts["packed"] > 0


def test_sampling_rows_draw_what_the_row_by_row_server_draws():
    d = drafter_of("plain")
    cfg = ServerConfig(fixed_branches=2)
    sampling = SamplingConfig(temperature=0.8)
    want = drive(DraftServer(d, cfg), 2, 5, sampling)
    got = drive(PackedDraftServer(d, cfg, plan=PackedPlan(graphs=False, rows=2)), 2, 5, sampling)
    assert got == want


def test_adapters_act_in_the_packed_step_after_the_backend_lays_out_the_projections():
    """The backend lays q, k, v and gate, up out for one product each; a projection with an
    adapter's hook keeps its own call, so the packed blocks still equal the row-by-row ones
    (one product skipped the adapters: scores off by ~0.7)."""
    d = drafter_of("adapters")
    CudaBackend(graphs=False).prepare_drafter(d.lm)
    a = d.lm.model.layers[0].self_attn
    assert joined(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) is not None
    p = packed(d)
    assert p.step.core.qkv == [None, None] and p.step.core.mlps[0] is d.lm.model.layers[0].mlp
    rows = [p.open(100) for _ in PREFIXES]
    p.run(rows, [x[:-1] for x in PREFIXES], NONE, NONE)
    visible = torch.tensor([[len(x) - 1] for x in PREFIXES])
    out = p.run(rows, [[] for _ in PREFIXES], visible, torch.tensor([[x[-1]] for x in PREFIXES]))
    for i, x in enumerate(PREFIXES):
        with torch.inference_mode():
            want = d.block_scores(x[-1], cache_of(d, x[:-1]), [])
        torch.testing.assert_close(out.blocks[i, 0], want, atol=1e-5, rtol=1e-5)


def test_the_cuda_backend_readies_the_worker_for_packed_drafting():
    d = drafter_of("plain")
    assert isinstance(server_for(d), DraftServer) and plan_of(d) is None
    CudaBackend(graphs=False).prepare_drafter(d.lm)
    assert plan_of(d) == PackedPlan(graphs=False)
    assert isinstance(server_for(d), PackedDraftServer)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 90 + 2 for j in range(3 + (11 * i) % 37)] for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_every_mode_with_the_packed_drafter_equals_ar(kind, packed_rows, monkeypatch):
    """The target's and the drafter's steps as their graphs would run them (here: rehearsed,
    d3d.backends.cuda.rehearsal)."""
    rehearsed: list[str] = []
    hazards: list[GraphHazard] = []  # the worker would answer a hazard with a failed draft
    run = Rehearsal.run

    def noted(self, x, n):
        rehearsed.append(type(self.step).__name__)
        try:
            return run(self, x, n)
        except GraphHazard as e:
            hazards.append(e)
            raise

    monkeypatch.setattr(Rehearsal, "run", noted)
    model = tiny_model(kind, seed=1)
    drafter = D3DDrafter.from_target(model, 1, base="tiny", block_size=6)
    backend = CudaBackend(graphs=True)
    backend.prepare_drafter(drafter.lm)
    engine = tiny_engine(model, drafter, backend=backend)
    try:
        sched = engine.scheduler(max_batch=8)
        sched.eos_ids = set()
        modes = ("ar", "sync", "async", "auto")
        ps = prompts(6)
        out: list[list[int]] = [[] for _ in ps]
        budgets = [12 + (5 * i) % 17 for i in range(len(ps))]
        for i, p in enumerate(ps):
            sched.add(GenRequest(p, budgets[i], mode=modes[i % 4], on_tokens=out[i].extend))
            if i >= 3:
                sched.step()
        while not sched.idle:
            sched.step()
        for i, p in enumerate(ps):
            assert out[i] == greedy_continuation(model, p, budgets[i]), f"row {i} ({modes[i % 4]})"
    finally:
        engine.close()
    assert packed_rows, "the worker drafted through the packed drafter"
    assert {"PackedForward", "StaticForward"} <= set(rehearsed), "both steps rehearsed"
    assert not hazards, hazards[0]


def test_sync_drafts_every_rows_block_in_one_packed_forward_on_the_worker(packed_rows):
    """Where the worker drafts packed (the cuda backend), ``sync`` drafts there: a step's
    blocks of every row in one forward, instead of a forward per row in the engine's thread
    (eager on a GPU: a 1.7B-shaped drafter's launches for each row); greedy equals ``ar``."""
    model = tiny_model("qwen3", seed=1)
    drafter = D3DDrafter.from_target(model, 1, base="tiny", block_size=6)
    plain = tiny_engine(model, drafter)
    try:
        assert type(plain.proposer("sync")).__name__ == "SyncProposer"  # not readied: in process
    finally:
        plain.close()
    CudaBackend(graphs=False).prepare_drafter(drafter.lm)
    engine = tiny_engine(model, drafter, backend=CudaBackend(graphs=False))
    try:
        proposer = engine.proposer("sync")
        assert isinstance(proposer, AsyncProposer) and not proposer.branches
        sched = engine.scheduler(max_batch=8)
        sched.eos_ids = set()
        ps = prompts(4)
        out: list[list[int]] = [[] for _ in ps]
        for i, p in enumerate(ps):
            sched.add(GenRequest(p, 20, mode="sync", on_tokens=out[i].extend))
        while not sched.idle:
            sched.step()
        for i, p in enumerate(ps):
            assert out[i] == greedy_continuation(model, p, 20), f"row {i}"
    finally:
        engine.close()
    assert max(packed_rows) == 4  # the four rows' blocks in one forward


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_captured_packed_steps_give_the_eager_steps_scores(device):
    """On a GPU, CUDA graphs; on the CPU, their rehearsal (d3d.backends.cuda.rehearsal)."""
    d = drafter_of("adapters").place(device)
    outs = {}
    for graphs in (True, False):
        p = PackedDrafter(d, PackedPlan(graphs=graphs, rows=4, kv_tokens=4 * 512))
        rows = [p.open(100) for _ in PREFIXES]
        none = NONE.to(device)
        p.run(rows, [x[:-1] for x in PREFIXES], none, none)
        gen = torch.Generator().manual_seed(0)
        got = []
        for n in (1, 3, 3, 1):
            chains = [torch.randint(TINY_VOCAB, (BK,), generator=gen).tolist() for _ in rows]
            vis = torch.tensor([[r.length + int(k) for k in torch.randint(BK, (n,), generator=gen)]
                                for r in rows], device=device)  # fmt: skip
            anchors = torch.randint(TINY_VOCAB, (len(rows), n), generator=gen).to(device)
            got.append(p.run(rows, chains, vis, anchors).blocks.cpu())
        outs[graphs] = got
        if graphs:
            assert p.runner.captured == 2 and p.counts["packed"] == 4
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_row_past_its_slot_fails_alone_and_the_others_step_on():
    d = drafter_of("plain")
    plan = PackedPlan(graphs=False, rows=2, kv_tokens=2 * 1024)
    server = PackedDraftServer(d, ServerConfig(fixed_branches=2), plan=plan)
    cap = server.packed.kv.capacity
    long = [j % 90 + 2 for j in range(cap - server.reserve - 2)]  # fits, with 2 to spare
    assert server.packed.kv.slots == 2
    list(server.handle(Open(1, [5, 6, 7, 8], SamplingConfig(), seed=1)))
    list(server.handle(Open(2, long, SamplingConfig(), seed=2)))
    out = list(server.handle(Commits([Commit(1, [9], 0.1), Commit(2, [9, 10, 11], 0.1)])))
    failed = [m for m in out if isinstance(m, Failed)]
    assert [m.sid for m in out if isinstance(m, Block)] == [1]
    assert [f.sid for f in failed] == [2] and f"at most {cap} tokens" in failed[0].message
    assert 2 not in server.sessions and len(server.packed.kv.rows) == 1  # its slot is free
    block = next(m for m in out if isinstance(m, Block))
    out = list(server.handle(Commits([Commit(1, [block.tokens[0], 3], 0.1)])))
    assert [type(m) for m in out] == [Block]
