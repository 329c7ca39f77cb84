"""Chunking, selection, prompt splitting and the model-free scorers (pure, milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from compression.compressor import CompressionConfig, Compressor
from compression.prompt import PromptParts, build_parts, middle_truncate
from compression.scorers import (
    BM25Scorer,
    HeadTailScorer,
    HybridScorer,
    RandomScorer,
    bm25,
    rank_fusion,
    words,
)
from compression.selection import budget, head_units, pool, select, smooth
from compression.units import Chunk, fixed_chunks, packed_chunks, segment, sentence_chunks


class CharTokenizer:
    """One token per character (id = code point); enough for prompts and scorers in tests."""

    chat_template = None
    bos_token_id = None
    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) > 0)


class FixedScorer:
    name = "fixed"
    token_level = False

    def __init__(self, scores):
        self.scores = torch.tensor(scores, dtype=torch.float32)

    def score(self, parts, units=()):
        return self.scores


def parts_of(n: int, prefix: int = 3, suffix: int = 2) -> PromptParts:
    return PromptParts(
        tuple(range(1000, 1000 + prefix)), tuple(range(n)), tuple(range(2000, 2000 + suffix))
    )


def test_budget():
    assert budget(100, 0.1) == 10
    assert budget(100, 1.0) == 100
    assert budget(3, 0.01) == 1
    assert budget(0, 0.5) == 0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            budget(10, bad)


def test_fixed_chunks_cover_everything():
    chunks = fixed_chunks(70, 32)
    assert chunks == [Chunk(0, 32), Chunk(32, 64), Chunk(64, 70)]
    assert fixed_chunks(0, 32) == []
    with pytest.raises(ValueError):
        fixed_chunks(5, 0)


def test_sentence_chunks_split_at_ends_and_cap_length():
    texts = list("ab. cd? efghijk")
    chunks = sentence_chunks(texts, max_len=4)
    assert chunks[0] == Chunk(0, 3)  # "ab."
    assert chunks[1] == Chunk(3, 7)  # " cd?"
    assert all(len(c) <= 4 for c in chunks)
    assert chunks[-1].end == len(texts)


def test_sentences_do_not_end_inside_numbers_and_end_at_lines():
    texts = ["Pi", " is", " 3", ".", "14", ".", " Next", ' one."', " x", "\n", "code", "()"]
    assert sentence_chunks(texts) == [Chunk(0, 6), Chunk(6, 8), Chunk(8, 10), Chunk(10, 12)]


def test_packed_chunks_keep_sentences_whole():
    # sentences of 5, 3, 6 and 40 characters (one token each)
    text = "Abcd." + "Ef." + "Ghijk." + "L" * 39 + "."
    texts = [c + " " if c == "." else c for c in text]
    sentences = sentence_chunks(texts, max_len=1000)
    assert [len(c) for c in sentences] == [5, 3, 6, 40]
    packed = packed_chunks(texts, size=10)
    assert packed[:2] == [Chunk(0, 8), Chunk(8, 14)]  # 5+3 fit in 10, the 6 goes on alone
    assert all(len(c) <= 10 for c in packed) and packed[-1].end == len(texts)
    assert sum(len(c) for c in packed) == len(texts)
    for c in packed[:2]:  # no packed unit cuts a sentence that fits
        assert any(s.start == c.start for s in sentences)
        assert any(s.end == c.end for s in sentences)
    assert segment(texts, "chunk", 10) == fixed_chunks(len(texts), 10)
    with pytest.raises(ValueError):
        segment(texts, "page", 10)


def test_smooth_and_pool():
    x = torch.tensor([0.0, 3.0, 0.0, 0.0])
    assert torch.allclose(smooth(x, 1), x)
    assert torch.allclose(smooth(x, 3), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    chunks = [Chunk(0, 2), Chunk(2, 4)]
    assert pool(x, chunks).tolist() == [1.5, 0.0]
    assert pool(x, chunks, "max").tolist() == [3.0, 0.0]
    with pytest.raises(ValueError):
        pool(x, chunks, "median")


def test_select_keeps_best_chunks_in_order_and_exact_budget():
    chunks = fixed_chunks(10, 3)  # [0,3) [3,6) [6,9) [9,10)
    scores = torch.tensor([0.1, 0.9, 0.5, 0.2])
    kept = select(scores, chunks, 5, cut_last=True)
    assert kept == [3, 4, 5, 6, 7]  # best chunk whole, the next one cut to its head
    assert kept == sorted(kept)
    assert select(scores, chunks, 0) == []
    assert select(scores, chunks, 10) == list(range(10))
    # NaN ranks last; ties go to the earlier chunk
    assert select(torch.tensor([float("nan"), 1.0, 1.0, 0.0]), chunks, 3) == [3, 4, 5]


def test_select_never_cuts_a_unit_and_fills_with_the_next_that_fits():
    chunks = fixed_chunks(10, 3)  # [0,3) [3,6) [6,9) [9,10)
    scores = torch.tensor([0.1, 0.9, 0.5, 0.2])
    # the 2nd best [6,9) does not fit in the 2 tokens left: the 1-token [9,10) does
    assert select(scores, chunks, 5) == [3, 4, 5, 9]


def test_select_extends_chosen_units_to_their_neighbours():
    chunks = fixed_chunks(20, 2)  # ten units
    scores = torch.zeros(10)
    scores[5], scores[1] = 2.0, 1.0
    assert select(scores, chunks, 6) == [0, 1, 2, 3, 10, 11]  # units 5, 1, then 0 (a tie)
    with_nb = select(scores, chunks, 6, neighbours=1)
    assert with_nb == [8, 9, 10, 11, 12, 13]  # unit 5 and its two neighbours, before unit 1


def test_compressor_keeps_prefix_and_suffix_and_budget():
    parts = parts_of(100)
    scores = [0.0] * 100
    scores[40:48] = [5.0] * 8
    cfg = CompressionConfig(scorer="random", chunk_size=8, granularity="chunk", gap="none")
    comp = Compressor(FixedScorer(scores), cfg)
    out = comp.compress(parts, 0.08)
    assert out.parts.prefix == parts.prefix and out.parts.suffix == parts.suffix
    assert out.kept == tuple(range(40, 48))
    assert out.parts.context == tuple(range(40, 48))
    assert out.kept_tokens == 3 + 8 + 2 and out.total_tokens == 105
    d = out.to_dict()
    assert d["kept_context_tokens"] == 8 and d["keep_ratio"] == 0.08
    # keep 1.0 returns the prompt unchanged without scoring
    full = comp.compress(parts, 1.0)
    assert full.parts == parts and full.seconds == 0.0


def test_compressor_checks_scorer_shape():
    comp = Compressor(
        FixedScorer([1.0, 2.0]), CompressionConfig("random", granularity="chunk", gap="none")
    )
    with pytest.raises(RuntimeError):
        comp.compress(parts_of(10), 0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scorer": "nope"},
        {"keep_ratio": 0.0},
        {"keep_ratio": 1.2},
        {"chunk_size": 0},
        {"granularity": "page"},
        {"gap": "dots"},
        {"pooling": "median"},
        {"neighbours": -1},
        {"fusion_weights": (1.0, -1.0)},
    ],
)
def test_compression_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        CompressionConfig(**kwargs)


def test_head_tail_matches_longbench_truncation():
    parts = parts_of(20)
    cfg = CompressionConfig(scorer="head-tail", chunk_size=4, granularity="chunk", gap="none")
    comp = Compressor(HeadTailScorer(), cfg)
    out = comp.compress(parts, 0.3)  # 6 tokens: first 3 and last 3
    assert out.kept == (0, 1, 2, 17, 18, 19)


def test_random_scorer_is_seeded_and_chunkwise():
    parts = parts_of(64)
    a, b = RandomScorer(1, 8).score(parts), RandomScorer(1, 8).score(parts)
    assert torch.equal(a, b)
    assert not torch.equal(a, RandomScorer(2, 8).score(parts))
    assert torch.all(a[:8] == a[0])


def test_bm25_prefers_the_chunk_with_question_words():
    assert words("The Cat and the HAT") == ["cat", "hat"]
    s = bm25(["paprika"], [["soup", "water"], ["paprika", "soup"], ["bread"]])
    assert s[1] > 0 and s[0] == 0 and s[2] == 0
    tok = CharTokenizer()
    context = "x" * 16 + "secret paprika!!" + "y" * 16
    parts = PromptParts((), tuple(tok(context)["input_ids"]), tuple(tok("paprika?")["input_ids"]))
    scores = BM25Scorer(tok, chunk_size=16).score(parts)
    assert scores.shape == (48,)
    assert scores[16:32].min() > scores[:16].max()
    units = [Chunk(0, 20), Chunk(20, 48)]  # the compressor's units, when given, are scored
    by_unit = BM25Scorer(tok).score(parts, units)
    assert torch.all(by_unit[:20] == by_unit[0]) and by_unit[20] > by_unit[0]


def test_rank_fusion_rewards_agreement_and_ignores_non_matches():
    att = torch.tensor([0.9, 0.1, 0.5, 0.3])
    lex = torch.tensor([0.0, 2.0, 1.0, 0.0])
    fused = rank_fusion([att, lex], [1.0, 1.0], k=3.0)
    # unit 2 is 2nd under both, unit 0 1st under attention only, unit 1 1st under BM25 only
    assert fused.argmax() == 2
    assert fused[0] == pytest.approx(1 / 4) and fused[1] == pytest.approx(1 / 7 + 1 / 4)
    assert fused[3] == pytest.approx(1 / 6)  # no BM25 credit for a zero score
    ties = rank_fusion([torch.tensor([1.0, 1.0, 0.5])], [1.0], k=0.0)
    assert ties.tolist() == [1.0, 1.0, pytest.approx(1 / 3)]


def test_hybrid_scorer_fuses_attention_and_bm25_per_unit():
    tok = CharTokenizer()
    context = "aaaa. " * 4 + "zzz paprika. " + "bbbb. " * 4
    parts = PromptParts((), tuple(tok(context)["input_ids"]), tuple(tok("paprika?")["input_ids"]))
    units = sentence_chunks([tok.decode([t]) for t in parts.context])
    att = torch.zeros(len(parts.context))
    att[units[-1].start : units[-1].end] = 1.0  # attention likes the last sentence only
    hybrid = HybridScorer(FixedScorer(att.tolist()), BM25Scorer(tok), (1.0, 1.0), k=1.0)
    scores = pool(hybrid.score(parts, units), units)
    needle = next(
        j for j, u in enumerate(units) if "paprika" in tok.decode(parts.context[u.start : u.end])
    )
    ranked = scores.argsort(descending=True).tolist()
    assert set(ranked[:2]) == {needle, len(units) - 1}  # each part's favourite survives fusion


def test_max_fusion_keeps_a_unit_only_one_ranking_finds_where_sum_fusion_drops_it():
    # Unit 0: the drafter's first choice, no question word (BM25 0). Units 1-3: both rank them
    # fairly high. Sum fusion prefers those; max fusion interleaves the two rankings' best.
    drafter = torch.tensor([4.0, 3.0, 2.5, 2.0, 0.1])
    lexical = torch.tensor([0.0, 2.0, 2.5, 3.0, 0.0])
    summed = rank_fusion([drafter, lexical], (1.0, 1.0), k=20.0, how="sum")
    best = rank_fusion([drafter, lexical], (1.0, 1.0), k=20.0, how="max")
    assert summed.argsort(descending=True).tolist()[:2] != [0, 3]
    assert 0 not in summed.argsort(descending=True).tolist()[:2]
    assert set(best.argsort(descending=True).tolist()[:2]) == {0, 3}
    with pytest.raises(ValueError, match="fusion"):
        rank_fusion([drafter], (1.0,), how="min")


def test_build_parts_splits_template_at_context():
    tok = CharTokenizer()
    parts = build_parts(tok, "Doc: {context}\nQ: {input}", "abc", input="why?")
    assert tok.decode(parts.prefix) == "Doc: "
    assert tok.decode(parts.context) == "abc"
    assert tok.decode(parts.suffix) == "\nQ: why?"
    with pytest.raises(ValueError):
        build_parts(tok, "no context here {input}", "abc", input="q")


def test_middle_truncate_keeps_first_and_last_halves():
    parts = parts_of(100, prefix=3, suffix=2)
    out = middle_truncate(parts, 21)
    assert len(out) == 21
    assert out.ids == parts.ids[:10] + parts.ids[-11:]
    assert middle_truncate(parts, 500) == parts
    with pytest.raises(ValueError):
        middle_truncate(parts_of(100, prefix=30), 40)


def test_prompt_parts_need_a_question():
    with pytest.raises(ValueError):
        PromptParts((1,), (2,), ())


def test_the_document_head_is_kept_first_for_any_question():
    """``head=0.5``: the leading units filling half the budget are kept whatever the scores,
    the rest goes to the best units; the head is a prefix of the kept context."""
    parts = parts_of(100)
    scores = [0.0] * 100
    scores[0:8] = [-1.0] * 8  # the head scores lowest
    scores[80:88] = [5.0] * 8
    cfg = CompressionConfig("random", chunk_size=8, granularity="chunk", head=0.5, gap="none")
    out = Compressor(FixedScorer(scores), cfg).compress(parts, 0.16)
    assert out.kept == (*range(0, 8), *range(80, 88))
    assert out.head == 8 and out.shared_prefix == len(parts.prefix) + 8
    assert out.to_dict()["head_tokens"] == 8
    plain = Compressor(FixedScorer(scores), replace(cfg, head=0.0)).compress(parts, 0.16)
    assert plain.head == 0 and 80 in plain.kept and 0 not in plain.kept
    assert head_units([Chunk(0, 5), Chunk(5, 9), Chunk(9, 20)], 9) == 2
    with pytest.raises(ValueError):
        CompressionConfig(head=1.0)
