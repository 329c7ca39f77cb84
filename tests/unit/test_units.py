"""Units on messy text (one line, run-on sentences) and selection that finishes a sentence.

The messy document (:mod:`eval.longbench.messy`) is tokenised with the real Qwen3 tokenizer;
everything else is pure and takes milliseconds.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from compression.compressor import CompressionConfig, Compressor, token_texts
from compression.prompt import build_parts
from compression.selection import select
from compression.units import Chunk, packed_chunks, segment, sentence_chunks
from eval.longbench.messy import FACTS, fact_kept

SIZE = 32


@pytest.fixture(scope="module")
def messy_tokens(qwen3_tokenizer, messy):
    """The twelve messy items, their document's token ids, token texts and character offsets."""
    tok = qwen3_tokenizer
    items = messy
    doc = items[0].context
    enc = tok(doc, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(i) for i in enc["input_ids"]]
    return items, doc, ids, token_texts(tok, ids), [tuple(o) for o in enc["offset_mapping"]]


def fact_tokens(doc: str, offsets, fact: str) -> tuple[int, int]:
    """Token range ``[first, last + 1)`` holding ``fact`` (the clause, case aside) in ``doc``."""
    at = doc.lower().index(fact.lower())
    first = next(i for i, (_, e) in enumerate(offsets) if e > at)
    last = next(i for i, (_, e) in enumerate(offsets) if e >= at + len(fact))
    return first, last + 1


def sliver(texts, u: Chunk) -> bool:
    return len(u) < 4 or len("".join(texts[u.start : u.end]).strip()) < 12


@pytest.mark.parametrize("granularity", ["packed", "sentence"])
def test_messy_units_cut_at_word_boundaries_within_size_and_without_slivers(
    messy_tokens, granularity
):
    _, _, ids, texts, _ = messy_tokens
    units = segment(texts, granularity, SIZE)
    assert units[0].start == 0 and units[-1].end == len(ids)
    assert all(a.end == b.start for a, b in itertools.pairwise(units))
    cap = SIZE if granularity == "packed" else 2 * SIZE
    assert max(len(u) for u in units) <= cap
    # one unit per sentence: "Why?" stands alone there; packed units are never slivers
    assert granularity == "sentence" or not [u for u in units if sliver(texts, u)]
    assert not [u for u in units if u.mid_sentence and sliver(texts, u)]
    for u in units[1:]:  # a cut falls between words, never inside one
        assert texts[u.start][:1].isspace() or texts[u.start - 1][-1:].isspace(), texts[
            u.start - 1 : u.start + 1
        ]


def test_each_messy_fact_lies_in_one_unit_or_one_sentences_run(messy_tokens):
    _, doc, _, texts, offsets = messy_tokens
    units = segment(texts, "packed", SIZE)
    for fact in FACTS:
        first, end = fact_tokens(doc, offsets, fact.text)
        span = [j for j, u in enumerate(units) if u.start < end and u.end > first]
        # units that continue one sentence: every one but the last ends mid-sentence
        assert all(units[j].mid_sentence for j in span[:-1]), fact.text
        # and the fact's clause is never cut at all (its clause fits a unit)
        assert len(span) == 1, (fact.text, [units[j] for j in span])


def test_bm25_keeps_the_literal_messy_facts_whole_at_keep_01(messy_tokens, qwen3_tokenizer):
    """Keyword questions find their fact with BM25; the fact must then survive whole. Fixed
    32-token packing cut a fact ending a run-on sentence (the Lisbon code)."""
    items = messy_tokens[0]
    comp = Compressor.build(CompressionConfig(scorer="bm25"), qwen3_tokenizer)
    literal = [it for it in items if not it.meta["paraphrased"]]
    assert len(literal) == 6
    lost = []
    for it in literal:
        parts = build_parts(qwen3_tokenizer, it.template, it.context, input=it.input)
        out = comp.compress(parts, 0.1)
        assert len(out.kept) <= round(0.1 * len(parts.context))
        if not fact_kept(it, qwen3_tokenizer.decode(out.parts.context)):
            lost.append(it.meta["needle"])
    assert not lost


def test_a_long_sentence_is_cut_at_clauses_then_words_never_inside_a_word():
    # one sentence of 3 clauses (6 + 7 + 6 tokens); the middle clause is one long word run
    texts = [
        *["The", " cat", " sat", " on", " the", " mat,"],
        *[" and", " then", " it", " slept", " very", " deeply", " there,"],
        *[" which", " was", " fine", " for", " everyone", "."],
    ]
    units = sentence_chunks(texts, max_len=8)
    assert units == [Chunk(0, 6, True), Chunk(6, 13, True), Chunk(13, 19)]
    # no clause fits: cut at the last word boundary that fits, before a conjunction if any
    words = ["Alpha", *[" w"] * 5, " and", *[" w"] * 6, "."]
    pieces = sentence_chunks(words, max_len=8)
    assert [(u.start, u.end) for u in pieces] == [(0, 6), (6, 14)]
    assert all(len(u) <= 8 for u in pieces)
    # a word longer than the size (a URL in pieces) is cut to size: nothing else fits
    url = ["See", " http", *["x"] * 10, " now", "."]
    assert all(len(u) <= 6 for u in sentence_chunks(url, max_len=6))


def test_no_sliver_piece_at_a_sentence_end():
    # a 10-token clause then a 2-token one: cutting after the comma would leave " end." alone
    texts = ["One", *[" w"] * 8, ",", " the", " end", "."]
    units = sentence_chunks(texts, max_len=10)
    assert all(len(u) >= 4 for u in units) and all(len(u) <= 10 for u in units)
    assert units[-1].end == len(texts) and not units[-1].mid_sentence


def test_packed_units_are_whole_sentences_or_pieces_of_one():
    short = [" Alpha", " beta", " gamma", " delta", "."]  # 5 tokens
    long = [" Long", *[" w"] * 8, ",", *[" x"] * 8, "."]  # 19 tokens, one clause cut
    texts = short + long + short
    units = packed_chunks(texts, size=12)
    assert units == [Chunk(0, 5), Chunk(5, 15, True), Chunk(15, 24), Chunk(24, 29)]


def test_select_brings_the_end_of_a_chosen_units_sentence():
    # sentence A: units 0-2 (0 and 1 end mid-sentence); sentence B: unit 3
    units = [Chunk(0, 4, True), Chunk(4, 8, True), Chunk(8, 12), Chunk(12, 16)]
    scores = torch.tensor([0.0, 1.0, 0.0, 0.5])
    assert select(scores, units, 8, finish=8) == list(range(4, 12))  # 1 brings 2
    assert select(scores, units, 12, finish=8) == list(range(4, 16))  # then the next best
    # the rest does not fit the budget: the unit alone, and the budget goes on down the ranking
    assert select(scores, units, 7, finish=8) == list(range(4, 8))
    # the rest is longer than ``finish``: not a sentence's tail but more text
    assert select(scores, units, 8, finish=3) == [*range(4, 8), *range(12, 16)]
    assert select(scores, units, 8) == [*range(4, 8), *range(12, 16)]  # finish=0: off
    # a chosen unit that already ends its sentence brings nothing
    assert select(torch.tensor([0.0, 0.0, 0.0, 1.0]), units, 4, finish=8) == list(range(12, 16))
    # the head of a sentence chosen first pulls the whole sentence's rest
    assert select(torch.tensor([1.0, 0.0, 0.0, 0.5]), units, 12, finish=8) == list(range(12))
