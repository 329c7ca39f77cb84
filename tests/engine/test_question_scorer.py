"""The ``drafter`` scorer (question likelihood per unit) on tiny random Llama / Qwen3 drafters.

Its batched, cached two-pass reading must give, for every unit, exactly the log-likelihood of
each question token that one plain forward over ``[unit, lead, question]`` gives, and the unit's
score their contrast over the units; a second question about the same document must not read the
units again.
"""

from __future__ import annotations

import pytest
import torch

from compression.compressor import CompressionConfig, Compressor, make_scorer
from compression.doc_cache import DocumentCache
from compression.prompt import PromptParts
from compression.question_scorer import DrafterQuestionScorer
from compression.scorers import contrast
from compression.units import Chunk
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model

VOCAB = 101


class IdTokenizer:
    """Text is space-separated token ids (enough for the lead's encoding)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [5, 6]}  # the lead: two fixed ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(f"w{i}" for i in ids)

    def batch_decode(self, batch) -> list[str]:
        return [self.decode(ids) for ids in batch]


def drafter(kind: str) -> D3DDrafter:
    target = tiny_model(kind, seed=0, vocab=VOCAB, layers=3, tie=False, window=512)
    return D3DDrafter.from_target(target, 3).eval()


def parts_and_units(n: int = 90, question: tuple[int, ...] = (40, 41, 42, 43, 44)):
    g = torch.Generator().manual_seed(2)
    ctx = tuple(torch.randint(7, VOCAB, (n,), generator=g).tolist())
    units = [Chunk(0, 7), Chunk(7, 30), Chunk(30, 31), Chunk(31, 60), Chunk(60, n)]
    return PromptParts((1, 2), ctx, (70, 71, *question), question), units


def reference(d: D3DDrafter, context, unit: Chunk, lead, question) -> list[float]:
    ids = torch.tensor([[*context[unit.start : unit.end], *lead, *question]])
    with torch.no_grad():
        logits = d.lm(input_ids=ids).logits[0].float()
    start = len(unit) + len(lead) - 1
    logp = torch.log_softmax(logits[start : start + len(question)], -1)
    return logp.gather(1, torch.tensor(question)[:, None])[:, 0].tolist()


def test_the_score_is_the_rise_above_the_typical_unit_token_by_token():
    lp = torch.tensor([[-1.0, -5.0], [-2.0, -1.0], [-3.0, -6.0]])  # [unit, question token]
    # medians -2 and -5: unit 0 rises 1 on the first token, unit 1 4 on the second
    torch.testing.assert_close(contrast(lp), torch.tensor([1.0, 4.0, 0.0]))
    torch.testing.assert_close(
        contrast(lp, torch.tensor([2.0, 0.5])), torch.tensor([2.0, 2.0, 0.0])
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("group", [1, 2, 64])
def test_batched_cached_scores_equal_one_plain_forward_per_unit(kind, group):
    d = drafter(kind)
    scorer = DrafterQuestionScorer(d, IdTokenizer(), group=group, workers=1)
    parts, units = parts_and_units()
    got = scorer.token_logprobs(parts, units)
    want = torch.tensor(
        [reference(d, parts.context, u, scorer.lead, parts.question) for u in units]
    )
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert torch.allclose(scorer.unit_scores(parts, units), contrast(want), atol=1e-4)


def test_second_question_reuses_the_reading_and_leaves_it_intact():
    d = drafter("llama")
    scorer = DrafterQuestionScorer(d, IdTokenizer(), group=2, workers=1)
    scorer.cache = DocumentCache()
    parts, units = parts_and_units()
    first = scorer.unit_scores(parts, units)
    reads = []
    original = scorer.read_group
    scorer.read_group = lambda *a: reads.append(a) or original(*a)  # type: ignore[method-assign]
    other = PromptParts(parts.prefix, parts.context, (70, 9, 8, 7), (9, 8, 7))
    second = scorer.unit_scores(other, units)
    again = scorer.unit_scores(parts, units)
    assert reads == []  # both answered from the cached reading
    want = [reference(d, parts.context, u, scorer.lead, other.question) for u in units]
    assert torch.allclose(second, contrast(torch.tensor(want)), atol=1e-4)
    assert torch.allclose(again, first, atol=1e-5)  # the question's KV was cut off again
    scorer._last = None  # not the memo: the cache itself
    assert torch.allclose(scorer.unit_scores(parts, units), first, atol=1e-5)


def test_without_a_question_it_reads_the_suffix_and_the_compressor_keeps_the_budget():
    d = drafter("llama")
    parts, _ = parts_and_units()
    bare = PromptParts(parts.prefix, parts.context, parts.suffix)
    scorer = DrafterQuestionScorer(d, IdTokenizer(), workers=1)
    assert scorer.question_ids(bare) == parts.suffix
    comp = Compressor(
        scorer, CompressionConfig("drafter", granularity="chunk", chunk_size=16, gap="none")
    )
    out = comp.compress(bare, 0.2)
    assert 0 < len(out.kept) <= round(0.2 * len(parts.context))


def test_hybrid_and_drafter_scorers_are_built_from_the_registry():
    d = drafter("llama")
    tok = IdTokenizer()
    assert make_scorer(CompressionConfig("drafter"), tok, d).name == "drafter"
    hybrid = make_scorer(CompressionConfig("hybrid"), tok, d)
    assert hybrid.name == "hybrid" and isinstance(hybrid.attention, DrafterQuestionScorer)
    with pytest.raises(ValueError, match="needs a drafter"):
        make_scorer(CompressionConfig("drafter"), tok)


def test_auto_reads_with_the_question_scorer_only_where_the_drafter_is_cheap_next_to_the_target():
    from compression.presets import reading_share, resolve_scorer

    target = tiny_model("llama", seed=0, vocab=VOCAB, layers=24, tie=False, window=512)
    small = D3DDrafter.from_target(target, 1)  # 1 of 24 layers: 1.5 / 24 of the prefill
    deep = D3DDrafter.from_target(target, 24)  # the target's own depth
    assert reading_share(small, target) == pytest.approx(1.5 / 24)
    assert resolve_scorer("auto", small, target) == "drafter"
    assert resolve_scorer("auto", deep, target) == "drafter-match"
    assert resolve_scorer("auto", None, target) == "bm25"
    assert resolve_scorer("drafter", deep, target) == "drafter"
    assert make_scorer(CompressionConfig("auto"), IdTokenizer(), small, target).name == "drafter"


@pytest.mark.slow
def test_embedded_drafter_keeps_the_paraphrased_facts_word_matching_cannot_find():
    """Messy needles (one-line essays, facts inside run-on sentences), the six questions worded
    with none of their fact's content words: at keep 0.1 the drafter scorer keeps them whole,
    BM25 at most one (measured on the 4,000-word document: 6 and 1, eval/results/recall; on the
    2,000-word one read here, half the time: 6 and 0)."""
    from compression.qa import DocumentQA
    from d3d.config import ModelConfig
    from d3d.engine import Engine
    from eval.longbench.messy import fact_kept, messy_items
    from eval.longbench.prompts import item_parts

    engine = Engine.from_config(ModelConfig(), with_drafter=True)
    tok = engine.tokenizer
    qa = DocumentQA(engine)
    items = [i for i in messy_items(words=2000) if i.meta["paraphrased"]]
    kept = {"drafter": 0, "bm25": 0}
    for item in items:
        parts = item_parts(item, tok, 8000)
        for name in kept:
            out = qa.compressor(name).compress(parts, 0.1)
            kept[name] += fact_kept(item, tok.decode(out.parts.context))
    assert kept["drafter"] >= 5 and kept["bm25"] <= 2, kept


def test_an_int8_reader_scores_close_to_the_float_one_and_is_a_reading_of_its_own():
    d = drafter("llama")
    parts, units = parts_and_units()
    exact = DrafterQuestionScorer(d, IdTokenizer(), workers=1)
    int8 = DrafterQuestionScorer(d, IdTokenizer(), quantize=True, workers=1)
    assert int8.model is not d and exact.model is d  # a copy: the drafter itself is untouched
    assert int8.reading_key(parts, units) != exact.reading_key(parts, units)
    got, want = int8.token_logprobs(parts, units), exact.token_logprobs(parts, units)
    assert torch.allclose(got, want, atol=0.05), (got, want)
