"""The engine's scheduler on tiny random models: every row's greedy output equals plain greedy
decoding of the target alone, whatever shares the batch, whenever it joins, whatever the drafter
does."""

from __future__ import annotations

import pytest
import torch

from d3d.backends.kv import GROW, KvLimitError, RowKV
from d3d.config import SamplingConfig
from d3d.engine import GenRequest, Scheduler
from d3d.model.drafter import D3DDrafter
from tests.conftest import (
    TINY_VOCAB,
    OracleDrafter,
    greedy_continuation,
    tiny_engine,
    tiny_model,
)


def make(model, drafter=None, block_size=16, max_batch=32, **kw) -> Scheduler:
    return tiny_engine(model, drafter, block_size).scheduler(max_batch=max_batch, **kw)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 45)), [5, 5, 5], [60, 61]]


class Collector:
    """Callbacks of one request: the tokens it streamed and how it ended."""

    def __init__(self):
        self.tokens: list[int] = []
        self.stats = None
        self.error = None

    def request(self, prompt, n, mode="auto", sampling=None) -> GenRequest:
        return GenRequest(
            list(prompt),
            max_new_tokens=n,
            mode=mode,
            sampling=sampling or SamplingConfig(),
            on_tokens=self.tokens.extend,
            on_finish=self.finish,
        )

    def finish(self, stats, error):
        self.stats, self.error = stats, error


def run_staggered(engine: Scheduler, modes, budgets) -> list[Collector]:
    """Two requests start together, the rest join while they run (continuous batching)."""
    out = [Collector() for _ in PROMPTS]
    for i in (0, 1):
        engine.add(out[i].request(PROMPTS[i], budgets[i], modes[i]))
    engine.step()
    engine.step()
    for i in range(2, len(PROMPTS)):
        engine.add(out[i].request(PROMPTS[i], budgets[i], modes[i]))
        engine.step()
    while not engine.idle:
        engine.step()
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("drafter_kind", ["none", "oracle", "wrong", "untrained"])
def test_batched_greedy_equals_alone(kind, drafter_kind):
    model = tiny_model(kind, seed=1)
    drafter = {
        "none": None,
        "oracle": OracleDrafter(model, block_size=6),
        "wrong": OracleDrafter(model, block_size=6, wrong=True),
        "untrained": D3DDrafter.from_target(model, 1, base="tiny"),
    }[drafter_kind]
    engine = make(model, drafter, block_size=6, max_batch=3)
    modes = (
        ["sync", "ar", "auto", "sync", "sync"] if drafter else ["auto", "ar", "auto", "auto", "ar"]
    )
    budgets = [20, 25, 30, 9, 17]
    out = run_staggered(engine, modes, budgets)
    for i, c in enumerate(out):
        assert c.error is None
        assert c.tokens == greedy_continuation(model, PROMPTS[i], len(c.tokens)), f"row {i}"
        assert c.stats.num_tokens == len(c.tokens)
        assert c.stats.stop_reason in ("eos", "length")
        if c.stats.stop_reason == "length":
            assert len(c.tokens) == budgets[i]
    spec_rows = [c for c, m in zip(out, modes, strict=True) if m == "sync"]
    if drafter is not None:
        assert all(c.stats.num_drafts > 0 for c in spec_rows)
    assert out[1].stats.num_drafts == 0  # ar rows never speculate
    if drafter_kind == "oracle":
        lengths = [c.stats.acceptance_length for c in spec_rows if c.stats.num_drafts > 1]
        assert lengths and min(lengths) > 3.0
    if drafter_kind == "wrong":
        assert all(c.stats.num_accepted_tokens == 0 for c in spec_rows)


def test_eos_inside_a_block_stops_the_row():
    model = tiny_model("llama", seed=3)
    ref = greedy_continuation(model, PROMPTS[0], 40)
    eos = ref[7]  # make a token the model emits early count as EOS
    engine = make(model, OracleDrafter(model, block_size=8))
    engine.eos_ids = {eos}
    c = Collector()
    engine.add(c.request(PROMPTS[0], 40, "sync"))
    while not engine.idle:
        engine.step()
    assert c.tokens == ref[: ref.index(eos) + 1]
    assert c.stats.stop_reason == "eos"


def test_cancel_drops_only_that_row():
    model = tiny_model("llama", seed=1)
    engine = make(model, max_batch=4)
    a, b = Collector(), Collector()
    ra = a.request(PROMPTS[0], 30)
    engine.add(ra)
    engine.add(b.request(PROMPTS[2], 30))
    engine.step()
    engine.step()
    ra.cancel()
    while not engine.idle:
        engine.step()
    assert a.stats.stop_reason == "cancelled" and len(a.tokens) < 30
    assert b.tokens == greedy_continuation(model, PROMPTS[2], 30)


def test_window_and_empty_prompt_are_refused_with_the_lengths():
    model = tiny_model("llama", seed=1, window=64)
    engine = make(model, block_size=16)
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\).*max_new_tokens \(20\).*64-token"):
        engine.add(GenRequest(list(range(1, 41)), max_new_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        engine.add(GenRequest([], max_new_tokens=5))


def test_sampling_rows_run_and_stay_in_vocab():
    model = tiny_model("qwen3", seed=2)
    drafter = D3DDrafter.from_target(model, 1, base="tiny")
    engine = make(model, drafter, max_batch=4)
    engine.eos_ids = set()
    outs = [Collector() for _ in range(3)]
    for i, c in enumerate(outs):
        s = SamplingConfig(temperature=0.8, top_p=0.9, seed=i)
        engine.add(c.request(PROMPTS[i], 12, "sync" if i else "ar", s))
    while not engine.idle:
        engine.step()
    for c in outs:
        assert len(c.tokens) == 12 and all(0 <= t < TINY_VOCAB for t in c.tokens)
    assert outs[1].stats.num_drafts > 0


def test_row_kv_rolls_rows_back_independently_and_grows_each_row_alone():
    kv = RowKV(
        num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", max_tokens=8 * GROW
    )
    a, b = kv.open(4 * GROW), kv.open(GROW)
    with torch.inference_mode():
        pos, batch = kv.begin([a, b], [3, 3])
        assert pos.tolist() == [[0, 1, 2, 0, 1, 2]]
        kv.update(torch.ones(1, 1, 6, 2), torch.ones(1, 1, 6, 2), 0)
        kv.commit(a, 3)
        kv.commit(b, 1)  # row b keeps one of three written positions (rollback)
        assert (a.length, b.length) == (3, 1)
        pos, batch = kv.begin([a, b], [2, 2])
        assert pos.tolist() == [[3, 4, 1, 2]]
        # two rows of two capacities (two slabs), two tokens each: a group per slab
        assert sorted((g.width, g.outputs.tolist()) for g in batch.groups) == [
            (2, [0, 1]),
            (2, [2, 3]),
        ]
        kv.update(torch.full((1, 1, 4, 2), 2.0), torch.zeros(1, 1, 4, 2), 0)
        # row b attends to its own keys only: its 1 kept + 2 new, not its stale ones
        k, _ = b.keys(0, 3)
        assert k[0, 0, :, 0].tolist() == [1.0, 2.0, 2.0]
        kv.commit(b, 2)
        # a long row grows its own buffers; the short row keeps its small capacity
        kv.begin([a], [2 * GROW])
        kv.update(torch.ones(1, 1, 2 * GROW, 2), torch.ones(1, 1, 2 * GROW, 2), 0)
        kv.commit(a, 2 * GROW)
        assert a.capacity >= 2 * GROW + 3 and b.capacity == GROW
        assert kv.snapshot(b).layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 2.0]
    assert kv.allocated_bytes <= kv.bound_tokens() * kv.bytes_per_token
    assert not kv.fits(4 * GROW)  # 5 of 8 are reserved
    with pytest.raises(KvLimitError, match=f"KV limit is {8 * GROW} tokens"):
        kv.check(9 * GROW)
    kv.close(a)
    assert kv.fits(7 * GROW)
    # rows alike in every field are still told apart (identical requests in one batch)
    c, d = kv.open(GROW), kv.open(GROW)
    with torch.inference_mode():
        kv.begin([c, d], [2, 2])
    kv.close(d)
    assert kv.rows == [b, c] and c.capacity == GROW


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_shared_prefix_is_encoded_once_and_reused_with_the_same_numbers(kind):
    """Questions about one document: the instruction and document head are encoded on their own
    the first time, taken from the prefix cache after, and every row still decodes as the
    target alone; rows with and without a shared prefix share the batch."""
    model = tiny_model(kind, seed=1)
    engine = make(model, max_batch=4)
    cache = engine.prefix_cache
    head = list(range(20, 44))
    prompts = [[*head, 5, 6, 7], [*head, 9, 10], [3, 4, 5, 6], [*head, 11]]
    out = [Collector() for _ in prompts]

    def request(i: int) -> GenRequest:
        req = out[i].request(prompts[i], 12, "ar")
        req.shared_prefix = len(head) if prompts[i][: len(head)] == head else 0
        return req

    engine.add(request(0))
    engine.add(request(2))  # no shared prefix, in the same prefill group
    engine.step()
    engine.add(request(1))
    engine.add(request(3))
    while not engine.idle:
        engine.step()
    for i, c in enumerate(out):
        assert c.error is None
        assert c.tokens == greedy_continuation(model, prompts[i], len(c.tokens)), f"row {i}"
    assert [c.stats.cached_prompt_tokens for c in out] == [0, len(head), 0, len(head)]
    assert len(cache) == 1 and cache.stats()["hits"] == 2
    # the reused KV is exactly what encoding the prefix on its own gives
    alone = make(model)
    solo = Collector()
    req = solo.request(prompts[1], 12, "ar")
    req.shared_prefix = len(head)
    alone.add(req)
    while not alone.idle:
        alone.step()
    assert solo.tokens == out[1].tokens and solo.stats.cached_prompt_tokens == 0
    stored = cache.lookup(head)
    assert stored is not None and stored.get_seq_length() == len(head)
    with torch.inference_mode():
        ref = model(torch.tensor([head]), use_cache=True).past_key_values
    for a, b in zip(stored.layers, ref.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_questions_arriving_together_read_their_shared_prefix_once(kind):
    """Three questions about one document arrive at once and the prefix takes several steps to
    read: one row reads it, the others wait for its KV and take it from the prefix cache, and
    every row decodes as the target alone. When the reading row is cancelled before it is done,
    a waiting row reads the prefix itself."""
    from d3d.engine.scheduler import PrefillBudget

    model = tiny_model(kind, seed=2)
    head = [(7 * i) % 90 + 3 for i in range(40)]
    prompts = [[*head, 5, 6], [*head, 9], [*head, 11, 12, 13]]
    for cancel in (False, True):
        engine = make(model, max_batch=4, prefill=PrefillBudget(min_chunk=8, max_chunk=8, short=0))
        out = [Collector() for _ in prompts]
        reqs = [out[i].request(p, 8, "ar") for i, p in enumerate(prompts)]
        for r in reqs:
            r.shared_prefix = len(head)
            engine.add(r)
        engine.step()
        if cancel:
            reqs[1].cancel()  # the shortest prompt: the row that reads the prefix
        while not engine.idle:
            engine.step()
        live = [i for i in range(3) if not (cancel and i == 1)]
        for i in live:
            assert out[i].error is None
            assert out[i].tokens == greedy_continuation(model, prompts[i], 8), (cancel, i)
        cached = [out[i].stats.cached_prompt_tokens for i in live]
        assert sorted(cached) == ([0, len(head)] if cancel else [0, len(head), len(head)])
        assert engine.prefix_cache.stats()["hits"] == len(live) - 1


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_auto_rows_verify_copies_of_their_own_text_and_stay_exact(kind):
    """A prompt that repeats itself: auto rows copy from their own tokens (no drafter, or beside a
    drafting row), ar rows never do, and every row still decodes as the target alone."""
    model = tiny_model(kind, seed=4)
    prompts = [[3, 4, 5, 6, 7, 8] * 5, [9, 10, 11] * 6, list(range(20, 40)) * 2]
    for drafter, modes in (
        (None, ["auto", "auto", "ar"]),
        (OracleDrafter(model, block_size=6, wrong=True), ["auto", "sync", "ar"]),
    ):
        engine = make(model, drafter, block_size=6)
        out = [Collector() for _ in prompts]
        for c, p, m in zip(out, prompts, modes, strict=True):
            engine.add(c.request(p, 24, m))
        while not engine.idle:
            engine.step()
        for i, c in enumerate(out):
            assert c.error is None
            assert c.tokens == greedy_continuation(model, prompts[i], len(c.tokens)), f"row {i}"
        assert out[0].stats.copy_drafts > 0
        assert out[2].stats.copy_drafts == 0  # ar
    off = make(model, block_size=6)
    c = Collector()
    req = c.request(prompts[0], 24, "auto")
    req.copy = False
    off.add(req)
    while not off.idle:
        off.step()
    assert c.stats.copy_drafts == 0 and c.tokens == out[0].tokens


def test_sampled_auto_rows_with_copies_run_and_stay_in_vocab():
    model = tiny_model("qwen3", seed=2)
    engine = make(model, block_size=6, max_batch=4)
    engine.eos_ids = set()
    outs = [Collector() for _ in range(2)]
    for c in outs:
        s = SamplingConfig(temperature=0.7)  # unseeded: a seeded auto row decodes plainly
        engine.add(c.request([3, 4, 5, 6, 7, 8] * 5, 16, "auto", s))
    while not engine.idle:
        engine.step()
    for c in outs:
        assert len(c.tokens) == 16 and all(0 <= t < TINY_VOCAB for t in c.tokens)
    assert sum(c.stats.copy_drafts for c in outs) > 0
