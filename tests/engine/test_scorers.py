"""Each scorer on tiny random-weight Llama / Qwen3 models (built from configs in milliseconds).

The drafter-attention scorer reads the prompt in two passes (sdpa prefill, then eager attention
for the final tokens over the cache); it must give exactly the attention weights of one eager
forward over the whole sequence with the same mask.
"""

from __future__ import annotations

import pytest
import torch

from compression.compressor import CompressionConfig, Compressor, make_scorer
from compression.drafter_scorers import (
    AttentionScoring,
    DrafterAttentionScorer,
    DrafterPerplexityScorer,
    windows,
)
from compression.prompt import PromptParts
from d3d.model import masks
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model as shared_tiny_model

VOCAB = 101


def tiny_model(kind: str = "llama", layers: int = 3, window: int = 512):
    return shared_tiny_model(kind, seed=0, vocab=VOCAB, layers=layers, tie=False, window=window)


def sample_parts(n_ctx: int = 50) -> PromptParts:
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(3, VOCAB, (n_ctx,), generator=g).tolist()
    return PromptParts((1, 2, 3), tuple(ctx), (70, 71, 72, 73))


def reference_attention(scorer: DrafterAttentionScorer, parts: PromptParts, lookahead: bool):
    """One eager forward over prefix + context + final tokens: [L, heads, Q, C]."""
    ref = D3DDrafter.from_target(scorer.model.lm, scorer.cfg.layers)
    ref.lm.set_attn_implementation("eager")
    ids = torch.tensor([parts.ids])
    emb = ref.lm.get_input_embeddings()(ids)
    n = emb.shape[1]
    mask = masks.causal_mask(0, n).clone()
    if lookahead:
        block = scorer.model.block_embeds(torch.tensor([parts.suffix[-1]]))
        emb = torch.cat([emb[:, :-1], block], 1)
        n = emb.shape[1]
        mask = masks.causal_mask(0, n).clone()
        mask[..., n - block.shape[1] :, :] = True
    with torch.no_grad():
        out = ref.lm.model(
            inputs_embeds=emb,
            attention_mask=masks.to_model_mask(mask, "eager", emb.dtype),
            position_ids=torch.arange(n)[None],
            output_attentions=True,
        )
    q = n - len(parts.prefix) - len(parts.context)
    p, s = len(parts.prefix), len(parts.prefix) + len(parts.context)
    return torch.stack([a[0, :, -q:, p:s] for a in out.attentions])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("lookahead", [False, True])
def test_attention_matches_one_eager_forward(kind, lookahead):
    model = tiny_model(kind)
    scorer = DrafterAttentionScorer(model, AttentionScoring(layers=2, lookahead=lookahead))
    parts = sample_parts()
    got = scorer.attention(parts)
    want = reference_attention(scorer, parts, lookahead)
    q = len(parts.suffix) - 1 + 16 if lookahead else len(parts.suffix)
    assert got.shape == (2, 4, q, 50)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the reader is back on sdpa after the eager query pass
    assert scorer.model.lm.config._attn_implementation == "sdpa"


def test_scores_reduce_over_layers_heads_queries_and_heads_option():
    model = tiny_model()
    parts = sample_parts()
    base = DrafterAttentionScorer(model, AttentionScoring(layers=2, lookahead=False))
    a = base.attention(parts)
    torch.testing.assert_close(base.score(parts), a.amax(0).amax(0).mean(0))
    picked = DrafterAttentionScorer(
        model, AttentionScoring(layers=2, lookahead=False, heads=((1, 2), (0, 1)))
    )
    want = torch.maximum(a[1, 2].mean(0), a[0, 1].mean(0))
    torch.testing.assert_close(picked.score(parts), want)
    with pytest.raises(ValueError):
        AttentionScoring(layers=2, heads=((2, 0),))
    with pytest.raises(ValueError):
        DrafterAttentionScorer(model, AttentionScoring(layers=5))


def test_long_context_is_scored_in_windows():
    model = tiny_model(window=512)
    parts = sample_parts(300)
    cfg = AttentionScoring(layers=2, lookahead=False, window=128)
    scorer = DrafterAttentionScorer(model, cfg)
    size = 128 - len(parts.prefix)  # the question goes after the window, whatever its length
    spans = windows(300, size)
    assert spans[0] == (0, size) and spans[-1][1] == 300
    scores = scorer.score(parts)
    assert scores.shape == (300,)
    s0, e0 = spans[1]
    alone = scorer.reduce(scorer.attention(parts, s0, e0))
    torch.testing.assert_close(scores[s0:e0], alone)


@pytest.mark.parametrize("quantize", [False, True])
def test_windows_read_side_by_side_give_the_numbers_of_one_after_another(quantize):
    """Several threads read windows (and run their query passes) on one model at once: each
    window's cache and scores are exactly those of reading it alone."""
    from dataclasses import replace

    from compression.doc_cache import DocumentCache

    model = tiny_model(window=512)
    parts = sample_parts(400)
    base = AttentionScoring(layers=2, lookahead=False, window=96, quantize=quantize, workers=1)
    serial = DrafterAttentionScorer(model, base)
    # the same reader model (int8 or not), read by four threads at once
    side = DrafterAttentionScorer.from_drafter(
        serial.model, replace(base, quantize=False, workers=4)
    )
    assert side.model is serial.model
    side.cache = DocumentCache()
    assert side.workers == 4
    one, four = serial.read(parts), side.read(parts)
    assert len(four.windows) >= 5
    for a, b in zip(one.windows, four.windows, strict=True):
        assert (a.start, a.end) == (b.start, b.end)
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    expected = serial.score(parts)
    assert torch.equal(side.score(parts), expected)
    assert torch.equal(side.score(parts), expected)  # from the document cache, queries in threads


def test_reader_workers_take_one_core_each(monkeypatch):
    from compression import reading

    monkeypatch.setattr(reading.os, "sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    assert reading.reader_workers(torch.device("cpu")) == 4
    assert reading.reader_workers(torch.device("cpu"), requested=3) == 3
    assert reading.reader_workers(torch.device("meta")) == 1  # an accelerator: one stream
    with pytest.raises(ValueError, match="workers"):
        AttentionScoring(workers=0)


def test_parallel_map_runs_each_worker_on_one_torch_thread():
    from compression.reading import parallel_map

    before = torch.get_num_threads()
    seen = parallel_map(lambda _: torch.get_num_threads(), list(range(4)), 2)
    assert seen == [1, 1, 1, 1] and torch.get_num_threads() == before


def test_parallel_map_keeps_order_and_raises_a_worker_error():
    from compression.reading import parallel_map

    assert parallel_map(lambda x: x * x, list(range(9)), 4) == [x * x for x in range(9)]

    def boom(x):
        if x == 3:
            raise RuntimeError("window 3 failed")
        return x

    with pytest.raises(RuntimeError, match="window 3"):
        parallel_map(boom, list(range(6)), 3)


def test_quantized_reader_runs_and_stays_close():
    model = tiny_model()
    parts = sample_parts()
    fp = DrafterAttentionScorer(model, AttentionScoring(layers=2, lookahead=False)).score(parts)
    q8 = DrafterAttentionScorer(
        model, AttentionScoring(layers=2, lookahead=False, quantize=True)
    ).score(parts)
    assert q8.shape == fp.shape and torch.isfinite(q8).all()
    assert torch.corrcoef(torch.stack([fp, q8]))[0, 1] > 0.9


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_perplexity_scorer_is_self_information(kind):
    model = tiny_model(kind)
    parts = sample_parts()
    scorer = DrafterPerplexityScorer.from_target(model, layers=2)
    scorer.head_rows = 7  # exercise the chunked LM head
    got = scorer.score(parts)
    ref = D3DDrafter.from_target(model, 2).lm
    ids = torch.tensor([parts.prefix + parts.context])
    with torch.no_grad():
        logp = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
    p = len(parts.prefix)
    want = -logp[p - 1 : p - 1 + 50].gather(1, ids[0, p : p + 50, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_make_scorer_readers_and_errors():
    target = tiny_model(layers=3)
    drafter = D3DDrafter.from_target(target, 1)
    cfg = CompressionConfig(
        scorer="drafter-attention", attention=AttentionScoring(layers=2, reader="target")
    )
    scorer = make_scorer(cfg, drafter=drafter, target=target)
    assert len(scorer.model.lm.model.layers) == 2  # the target's layers, not the drafter's one
    torch.testing.assert_close(scorer.model.mask_embedding, drafter.mask_embedding)
    with pytest.raises(ValueError):  # the drafter has one layer: it cannot read two deep
        make_scorer(
            CompressionConfig("drafter-attention", attention=AttentionScoring(layers=2)),
            drafter=drafter,
        )
    with pytest.raises(ValueError):  # hybrid needs a tokenizer for its BM25 half
        make_scorer(CompressionConfig("hybrid"), drafter=drafter)
    with pytest.raises(ValueError):
        AttentionScoring(reader="target")  # a target reader needs a depth
    with pytest.raises(ValueError):
        make_scorer(CompressionConfig(scorer="drafter-ppl"))
    with pytest.raises(ValueError):
        make_scorer(CompressionConfig(scorer="bm25"))


@pytest.mark.parametrize("name", ["drafter-attention", "drafter-ppl"])
def test_compressor_with_drafter_scorers_keeps_budget_and_order(name):
    target = tiny_model()
    drafter = D3DDrafter.from_target(target, 2)
    cfg = CompressionConfig(
        scorer=name,
        chunk_size=8,
        granularity="chunk",
        gap="none",  # no tokenizer: the kept ids joined as they are
        attention=AttentionScoring(layers=2, lookahead=True),
    )
    comp = Compressor.build(cfg, drafter=drafter, target=target)
    parts = sample_parts(100)
    out = comp.compress(parts, 0.25)
    assert len(out.kept) == 25 and list(out.kept) == sorted(out.kept)
    assert out.parts.prefix == parts.prefix and out.parts.suffix == parts.suffix
    assert out.parts.context == tuple(parts.context[i] for i in out.kept)
    assert out.seconds > 0


def test_calibration_rank_fraction():
    from eval.longbench.calibrate import rank_fraction

    scores = torch.zeros(128)
    scores[70] = 1.0  # evidence in chunk 2 of 4 scores highest
    assert rank_fraction(scores, (64, 80)) == 0.0
    scores[5] = 10.0  # now chunk 0 beats it
    assert rank_fraction(scores, (64, 80)) == 0.25


def test_drafter_reader_reads_through_body_with_early_exit_and_reuses_its_pass():
    target = tiny_model(layers=3)
    drafter = D3DDrafter.from_target(target, 3)
    calls = []
    body = drafter.body
    drafter.body = lambda *a, **k: calls.append(1) or body(*a, **k)  # type: ignore[method-assign]
    parts = sample_parts()
    shallow = DrafterAttentionScorer.from_drafter(
        drafter, AttentionScoring(heads=((1, 2),), lookahead=False)
    )
    assert shallow.depth == 2 and not shallow.full_depth
    reading = shallow.read(parts)
    assert len(reading.windows[0].cache.layers) == 2  # layer 2 never ran
    assert not reading.drafter_cache
    # the drafter's first two layers read exactly as the target's first two layers do
    ref = DrafterAttentionScorer(
        target, AttentionScoring(layers=2, reader="target", lookahead=False)
    )
    torch.testing.assert_close(
        shallow.attention(parts)[0, 2], ref.attention(parts)[1, 2], atol=1e-5, rtol=1e-4
    )
    assert calls  # every forward went through D3DDrafter.body
    # a cached document pass gives the same scores; a second question reuses it
    from compression.doc_cache import DocumentCache

    full = DrafterAttentionScorer.from_drafter(drafter, AttentionScoring())
    full.cache = DocumentCache()
    first = full.score(parts)
    n_calls = len(calls)
    again = full.score(parts)
    torch.testing.assert_close(first, again)
    assert len(calls) == n_calls + 1  # the query pass only
    other = PromptParts(parts.prefix, parts.context, (80, 81))
    assert full.score(other).shape == (50,) and full.cache.stats()["hits"] == 2
    reading = full.read(parts)
    assert reading.drafter_cache and reading.windows[0].cache.get_seq_length() == 53


def test_quantized_copy_of_the_drafter_leaves_the_drafter_alone():
    target = tiny_model(layers=2)
    drafter = D3DDrafter.from_target(target, 2)
    before = drafter.lm.model.layers[0].self_attn.q_proj
    scorer = DrafterAttentionScorer.from_drafter(drafter, AttentionScoring(quantize=True))
    assert drafter.lm.model.layers[0].self_attn.q_proj is before
    assert scorer.model is not drafter
    assert scorer.model.lm.get_input_embeddings() is drafter.lm.get_input_embeddings()
    assert scorer.score(sample_parts()).shape == (50,)


def test_the_document_pass_stops_once_the_last_layer_has_cached_its_keys():
    """The last reading layer's attention output and MLP feed nothing: they never run in the
    document pass (the query pass runs them), and the scores still match (the test above)."""
    model = tiny_model(layers=3)
    scorer = DrafterAttentionScorer(model, AttentionScoring(layers=2, lookahead=False))
    ran = []
    for i, layer in enumerate(scorer.model.lm.model.layers):
        layer.mlp.register_forward_hook(lambda *_, i=i: ran.append(i))
    parts = sample_parts()
    cache = scorer.read_window(parts.prefix, parts.context)
    assert ran == [0] and len(cache.layers) == 2
    assert cache.get_seq_length() == len(parts.prefix) + len(parts.context)
    scorer.query(cache, parts.suffix, len(parts.prefix))
    assert ran == [0, 0, 1]


def test_a_reading_on_disk_serves_a_new_reader_with_the_same_weights_only(tmp_path):
    from compression.doc_cache import DocumentCache

    parts = sample_parts(120)
    cfg = AttentionScoring(lookahead=False, window=64, quantize=True, heads=((1, 0),))

    def reader(seed: int) -> DrafterAttentionScorer:
        drafter = D3DDrafter.from_target(shared_tiny_model("llama", seed=seed, vocab=VOCAB), 2)
        scorer = DrafterAttentionScorer.from_drafter(drafter, cfg)
        scorer.cache = DocumentCache(directory=tmp_path)
        return scorer

    first = reader(0)
    expected = first.score(parts)
    first.cache.flush()
    again = reader(0)  # a later process: another int8 copy of the same weights
    assert again.identity == first.identity and again.model is not first.model
    assert torch.equal(again.score(parts), expected)
    assert again.cache.stats()["disk_hits"] == 1
    other = reader(1)  # other weights: its own key, so it reads the document itself
    assert other.identity != first.identity
    other.score(parts)
    assert other.cache.stats()["disk_hits"] == 0


@pytest.mark.parametrize("window", [128, None])
def test_a_cached_reading_scores_a_question_as_a_fresh_one_whoever_read_it_first(window):
    """Windows are cut the same for every question: a question scored on a reading another
    question (of another length) made gets exactly the scores of a fresh reading."""
    from compression.doc_cache import DocumentCache

    model = tiny_model(window=512)
    cfg = AttentionScoring(layers=2, lookahead=False, window=window)
    scorer = DrafterAttentionScorer(model, cfg)
    scorer.cache = DocumentCache()
    base = sample_parts(700)
    short = PromptParts(base.prefix, base.context, (70, 71))
    long = PromptParts(base.prefix, base.context, tuple(range(40, 70)))
    fresh = {}
    for parts in (short, long):
        scorer.cache.clear()
        fresh[parts.suffix] = scorer.score(parts)
    scorer.cache.clear()
    scorer.score(long)  # the long question reads the document ...
    assert torch.equal(scorer.score(short), fresh[short.suffix])  # ... the short one reuses it
    scorer.cache.clear()
    scorer.score(short)
    assert torch.equal(scorer.score(long), fresh[long.suffix])
