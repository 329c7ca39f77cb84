"""The kept prompt: kept runs in document order with a marker at each cut (compression.gaps)."""

from __future__ import annotations

import pytest

from app.documents import kept_spans
from compression.compressor import CompressionConfig, Compressor, token_texts
from compression.gaps import GapMarker, runs
from compression.prompt import PromptParts, build_parts
from eval.longbench.messy import fact_kept
from tests.unit.test_compression import CharTokenizer


@pytest.fixture(scope="module")
def literal(qwen3_tokenizer, messy):
    """The messy document's six keyword questions as prompt parts (Qwen3 chat template)."""
    tok = qwen3_tokenizer
    return [
        (it, build_parts(tok, it.template, it.context, input=it.input))
        for it in messy
        if not it.meta["paraphrased"]
    ]


def test_runs():
    assert runs([]) == []
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]


def test_markers_go_where_text_was_cut_without_doubling_spaces():
    tok = CharTokenizer()
    enc = lambda text: tuple(tok(text)["input_ids"])  # noqa: E731
    parts = PromptParts(enc("P: "), enc("ab cd ef gh"), enc("\nQ?"))
    dots = GapMarker("ellipsis", tok)
    # "ab" and " ef" kept: a marker between them and one after " ef" (" gh" was cut); the
    # space " ef" brings is not doubled, nor the one the suffix's newline stands for
    assert tok.decode(dots.join(parts, [0, 1, 5, 6, 7])) == "ab ... ef ..."
    # a first run that does not open the document: a marker before it, after the prefix's space
    assert tok.decode(dots.join(parts, [2, 3, 4])) == "... cd ..."
    assert tok.decode(dots.join(parts, [8, 9, 10])) == "... gh"  # it reaches the end: no marker
    assert dots.join(parts, range(11)) == list(parts.context)  # nothing cut, nothing marked
    lines = GapMarker("newline", tok)
    assert tok.decode(lines.join(parts, [0, 1, 5, 6, 7])) == "ab\n ef\n"
    assert GapMarker("none").join(parts, [0, 1, 5, 6, 7]) == [*enc("ab"), *enc(" ef")]
    with pytest.raises(ValueError):
        GapMarker("ellipsis")  # a marker needs a tokenizer to be encoded
    with pytest.raises(ValueError):
        GapMarker("dots", tok)


def test_kept_prompt_marks_every_cut_and_keeps_the_shared_prefix(literal, qwen3_tokenizer):
    tok = qwen3_tokenizer
    comp = Compressor.build(CompressionConfig(scorer="bm25"), tok)
    assert comp.cfg.gap == "ellipsis"
    for it, parts in literal:
        out = comp.compress(parts, 0.1)
        n = len(parts.context)
        spans = out.spans
        assert [i for a, b in spans for i in range(a, b)] == list(out.kept)
        text = tok.decode(out.parts.context)
        assert text.count(" ... ") >= len(spans) - 1
        # the kept text is the kept runs in order, " ... " where text was cut (spacing aside)
        inner = " ... ".join(tok.decode(parts.context[a:b]) for a, b in spans)
        lead, trail = spans[0][0] > 0, spans[-1][1] < n
        assert text.split() == f"{'...' * lead} {inner} {'...' * trail}".split()
        assert out.to_dict()["marker_tokens"] == len(out.parts.context) - len(out.kept) > 0
        # the document's head opens the kept context: the shared prefix has no marker in it
        assert out.head > 0 and spans[0] == (0, spans[0][1]) and spans[0][1] >= out.head
        shared = [*parts.prefix, *parts.context[: out.head]]
        assert out.parts.ids[: out.shared_prefix] == shared
        assert fact_kept(it, text)


def test_gap_none_is_the_old_prompt_and_keep_one_is_the_prompt(literal, qwen3_tokenizer):
    tok = qwen3_tokenizer
    dots = Compressor.build(CompressionConfig(scorer="bm25"), tok)
    plain = Compressor.build(CompressionConfig(scorer="bm25", gap="none"), tok)
    lines = Compressor.build(CompressionConfig(scorer="bm25", gap="newline"), tok)
    for _, parts in literal[:2]:
        a, b, c = (comp.compress(parts, 0.1) for comp in (dots, plain, lines))
        assert a.kept == b.kept == c.kept
        assert b.parts.context == tuple(parts.context[i] for i in b.kept)
        assert b.to_dict()["marker_tokens"] == 0
        # the essay text is one line: every newline in the kept text is a marker
        gaps = len(a.spans) - 1 + (a.spans[0][0] > 0) + (a.spans[-1][1] < len(parts.context))
        assert tok.decode(c.parts.context).count("\n") == gaps
        assert dots.compress(parts, 1.0).parts == parts
        scored = dots.score(parts)
        assert dots.select(parts, scored, 1.0).parts == parts  # selected, not short-cut


def test_the_run_holding_a_fact_ends_its_sentence(literal, qwen3_tokenizer):
    """A piece chosen for its fact brings the rest of its run-on sentence (when short enough)."""
    tok = qwen3_tokenizer
    comp = Compressor.build(CompressionConfig(scorer="bm25"), tok)
    for it, parts in literal:
        out = comp.compress(parts, 0.1)
        texts = token_texts(tok, parts.context)
        for a, b in out.spans:
            run = "".join(texts[a:b])
            if it.meta["needle"].lower() in run.lower():
                assert run.rstrip().endswith((".", "!", "?", '"')), run[-60:]
                break
        else:
            raise AssertionError(f"no kept run holds {it.meta['needle']!r}")


def test_service_spans_are_the_kept_runs():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 10), (10, 14)]
    assert kept_spans(offsets, [(0, 2), (3, 5)]) == [[0, 5], [9, 14]]
    assert kept_spans(offsets, [(1, 2)]) == [[3, 5]]
    assert kept_spans([(0, 2), (2, 2), (2, 4)], [(0, 1), (2, 3)]) == [[0, 4]]  # touching: one
