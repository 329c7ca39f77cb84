"""The reasoning split (:mod:`app.reasoning`) on Qwen3 token streams: the real tokenizer's ids
through the service's incremental detokeniser, in every chunking, give the same reasoning and
content as the whole answer, and ``content`` never holds a think tag."""

from __future__ import annotations

import random

import pytest

from app.reasoning import (
    ReasoningSplitter,
    Split,
    has_reasoning_tags,
    split_reasoning,
    splitter_for,
)
from app.text import TextStream
from d3d.model.load import encode_messages
from tests.conftest import THINK_END_ID, THINK_START_ID, tiny_tokenizer


def stream_split(tokenizer, ids, sizes, thinking=False, stop=()) -> tuple[Split, list[Split]]:
    """Push ``ids`` in chunks of ``sizes`` through TextStream and the splitter, as the route does."""
    text, splitter = TextStream(tokenizer, stop), ReasoningSplitter(thinking)
    pieces, i = [], 0
    for n in sizes:
        pieces.append(splitter.push(text.push(ids[i : i + n])))
        i += n
    pieces.append(splitter.push(text.push(ids[i:])))
    pieces.append(splitter.push(text.flush()) + splitter.flush())
    total = Split()
    for p in pieces:
        total += p
    return total, pieces


def chunkings(n: int, rng: random.Random, count: int = 25):
    yield [1] * n  # one token per round (plain decoding)
    yield [n]  # everything at once (a full speculative block)
    for _ in range(count):
        sizes, left = [], n
        while left > 0:
            sizes.append(rng.randint(1, min(16, left)))
            left -= sizes[-1]
        yield sizes


ANSWERS = [
    (
        "<think>\nLet me think.\n\nStill thinking.\n</think>\n\nParis.",
        "Let me think.\n\nStill thinking.",
        "Paris.",
    ),
    ("<think>\n\n</think>\n\nJust the answer.", "", "Just the answer."),
    ("No thinking at all, 2 < 3 and x<th.", "", "No thinking at all, 2 < 3 and x<th."),
    ("<think>\nCut off by the budget, still thinking", "Cut off by the budget, still thinking", ""),
    ("Stray </think>end tag <think>a</think>b", "a", "Stray end tag b"),
]


@pytest.mark.parametrize(("answer", "reasoning", "content"), ANSWERS)
def test_every_chunking_of_a_token_stream_splits_the_same(
    qwen3_tokenizer, answer, reasoning, content
):
    ids = qwen3_tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert split_reasoning(answer) == Split(reasoning, content)
    rng = random.Random(0)
    for sizes in chunkings(len(ids), rng):
        total, pieces = stream_split(qwen3_tokenizer, ids, sizes)
        assert total == Split(reasoning, content), sizes
        assert all("<think>" not in p.content and "</think>" not in p.content for p in pieces)


def test_the_tags_are_single_ordinary_tokens_that_detokenising_keeps(qwen3_tokenizer):
    assert qwen3_tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [
        THINK_START_ID,
        THINK_END_ID,
    ]
    assert qwen3_tokenizer.decode([THINK_START_ID], skip_special_tokens=True) == "<think>"
    assert has_reasoning_tags(qwen3_tokenizer)
    assert not has_reasoning_tags(tiny_tokenizer())


def test_partial_tags_are_held_back_and_never_withdrawn():
    s = ReasoningSplitter()
    assert s.push("Hello <th") == Split(content="Hello ")
    assert s.push("ink>\nhm\n") == Split(reasoning="hm")  # the newline waits: more may follow
    assert s.push("\n") == Split()
    assert s.push("more</thi") == Split(reasoning="\n\nmore")
    assert s.push("nk>\n\nDone <") == Split(content="Done ")
    assert s.flush() == Split(content="<")  # at the end a tag's head is just text


def test_a_prompt_ending_in_an_open_think_block_starts_in_reasoning(qwen3_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    closed = encode_messages(qwen3_tokenizer, msgs)  # non-thinking: an empty, closed block
    thinking = encode_messages(qwen3_tokenizer, msgs, enable_thinking=True)
    opened = [*thinking, THINK_START_ID, *qwen3_tokenizer("\n")["input_ids"]]
    assert not splitter_for(qwen3_tokenizer, closed).thinking
    assert not splitter_for(qwen3_tokenizer, thinking).thinking
    assert splitter_for(qwen3_tokenizer, opened).thinking
    assert splitter_for(tiny_tokenizer(), [1, 2, 3]) is None
    assert split_reasoning("\nwhy\n</think>\n\nbecause", thinking=True) == Split("why", "because")


def test_stop_strings_apply_before_the_split(qwen3_tokenizer):
    answer = "<think>plan</think>\n\nOne. Two. Three."
    ids = qwen3_tokenizer(answer, add_special_tokens=False)["input_ids"]
    total, _ = stream_split(qwen3_tokenizer, ids, [1] * len(ids), stop=["Two"])
    assert total == Split("plan", "One. ")
