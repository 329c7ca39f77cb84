"""DocumentQA on a tiny engine: compressors built once, the document read once for several
questions, one definition of total_s, drafting from the full document is lossless."""

from __future__ import annotations

import pytest

from compression.compressor import DEFAULT_SCORER, CompressionConfig
from compression.drafter_scorers import AttentionScoring
from compression.qa import DocumentQA, Timings
from d3d.config import DecodeConfig
from tests.engine.test_longbench_harness import tiny_engine

DOC = "the cat sat on the mat. " * 10 + "the key is in the red box. " + "dogs bark at night. " * 10


def tiny_qa() -> DocumentQA:
    att = AttentionScoring(layers=1, heads=((0, 1),), lookahead=True)
    return DocumentQA(tiny_engine(), CompressionConfig(chunk_size=8, attention=att))


def test_second_question_reuses_the_reading_and_compressors_are_built_once():
    qa = tiny_qa()
    dcfg = DecodeConfig(mode="ar", max_new_tokens=4)
    first, second = qa.answer_all(DOC, ["where is the key?", "what barks?"], dcfg, 0.2)
    assert not first.cached and second.cached  # the default's states are kept by the scorer
    for scorer in ("attention-bm25", "drafter", "hybrid"):  # each reader says what it kept
        rs = qa.answer_all(DOC, ["where is the key?", "what barks?"], dcfg, 0.2, scorer)
        assert [r.cached for r in rs] == [scorer == "hybrid", True], scorer  # hybrid: drafter's
    assert qa.cache.stats()["hits"] >= 1 and len(qa.cache) == 2  # the two readers' passes
    assert qa.compressor() is qa.compressor(DEFAULT_SCORER)
    assert qa.compressor("drafter-attention").scorer is qa.attention()  # one shared reader
    for r in (first, second):
        t = r.timings
        assert t.total_s == pytest.approx(t.tokenize_s + t.compress_s + t.prefill_s + t.decode_s)
        d = r.to_dict()
        assert d["timings"]["total_s"] == round(t.total_s, 4)
        assert d["compression"]["kept_context_tokens"] <= round(
            0.2 * d["compression"]["context_tokens"]
        )
    # keep 1.0 is the full prompt, read by no scorer
    full = qa.answer(DOC, "where is the key?", dcfg, keep_ratio=1.0)
    assert full.compression.kept_tokens == full.compression.total_tokens
    assert full.timings.compress_s == 0.0
    with pytest.raises(ValueError):
        qa.answer("  ", "q?", dcfg)
    with pytest.raises(ValueError):
        qa.answer(DOC, " ", dcfg)


def test_timings_sum():
    t = Timings(0.1, 0.2, 0.3, 0.4)
    assert t.total_s == pytest.approx(1.0) and t.to_dict()["total_s"] == 1.0


def test_drafting_from_the_full_document_gives_the_same_answer():
    qa = tiny_qa()
    if "draft_prompt_ids" not in qa.engine.generate_ids.__code__.co_varnames:
        pytest.skip("the engine has no draft_prompt_ids yet")
    dcfg = DecodeConfig(mode="sync", max_new_tokens=8)
    kept = qa.answer(DOC, "where is the key?", dcfg, 0.2)
    whole = qa.answer(DOC, "where is the key?", dcfg, 0.2, draft_from_document=True)
    assert whole.answer == kept.answer
    assert whole.speculative["num_drafts"] > 0


def test_the_document_head_is_encoded_once_while_the_reader_scores_and_reused():
    """With a head share, the instruction and the document's head open every question's kept
    prompt: the target encodes them beside the reader's pass (the first question's prefill then
    starts after them), keeps their KV, and the second question starts from it. Answers equal
    those of an engine that encodes each prompt in the request (greedy, token for token)."""
    from dataclasses import replace

    qa = tiny_qa()
    qa.cfg = replace(qa.cfg, head=0.5)
    qa._compressors.clear()
    dcfg = DecodeConfig(mode="ar", max_new_tokens=8)
    questions = ["where is the key?", "what barks?"]
    first, second = qa.answer_all(DOC, questions, dcfg, 0.2)
    head = second.compression.shared_prefix
    assert second.compression.head > 0 and first.compression.shared_prefix == head
    assert first.speculative["cached_prompt_tokens"] == head
    assert second.speculative["cached_prompt_tokens"] == head
    assert len(qa.engine.prefix_cache) == 1
    qa.forget()
    qa.overlap = lambda scorer=None: False  # the request encodes the head itself
    cold = qa.answer_all(DOC, questions, dcfg, 0.2)
    assert [r.speculative["cached_prompt_tokens"] for r in cold] == [0, head]
    assert [r.answer for r in cold] == [first.answer, second.answer]


def test_full_prompt_questions_share_the_whole_document_and_answer_as_alone():
    """Keep 1.0 cuts nothing, so the instruction and the whole document open every question's
    prompt: the second question reads only its own suffix from the prefix cache, and both
    answers equal those of a cold engine (greedy, token for token)."""
    qa = tiny_qa()
    dcfg = DecodeConfig(mode="ar", max_new_tokens=6)
    questions = ["where is the key?", "what barks?"]
    first, second = qa.answer_all(DOC, questions, dcfg, 1.0)
    shared = first.compression.shared_prefix
    assert first.compression.head == first.compression.context_tokens
    assert shared == first.compression.total_tokens - len(first.compression.parts.suffix)
    assert first.speculative["cached_prompt_tokens"] == 0
    assert second.speculative["cached_prompt_tokens"] == shared
    qa.forget()
    cold = qa.answer(DOC, questions[1], dcfg, 1.0)
    assert cold.speculative["cached_prompt_tokens"] == 0
    assert cold.answer == second.answer
