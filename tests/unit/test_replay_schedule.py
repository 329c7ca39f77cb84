"""The replay instrument's pure parts: its spec, the corruption schedule, decoys, the book."""

from __future__ import annotations

import pytest

from d3d.config import SamplingConfig
from d3d.model.meta import DrafterError
from d3d.replay import ReplayBook, ReplaySpec, is_replay, parse_replay
from d3d.replay.schedule import Diffuser, Replay, corrupt, decoys


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("replay:7.88", ReplaySpec(7.88, 0.78, None)),
        ("replay:7.88:0.5", ReplaySpec(7.88, 0.5, None)),
        ("replay:3:self:4", ReplaySpec(3.0, 0.78, "self:4")),
        ("replay:7.88:0.78:self:0,5,9", ReplaySpec(7.88, 0.78, "self:0,5,9")),
        ("replay:7.88:shape=qwen3-8b@31", ReplaySpec(7.88, 0.78, "shape=qwen3-8b@31")),
    ],
)
def test_specs_parse(text, want):
    assert is_replay(text) and parse_replay(text) == want
    assert parse_replay(want.text) == want
    assert want.label.endswith("(measurement instrument)")


@pytest.mark.parametrize("text", ["replay:", "replay:x", "replay:0.5", "replay:4:1.5", "replay:4:"])
def test_bad_specs_name_the_problem(text):
    with pytest.raises(DrafterError, match="replay"):
        parse_replay(text)


def test_tau_cannot_exceed_a_block():
    with pytest.raises(DrafterError, match="block size 16"):
        ReplaySpec(16.5).check_block(16)
    ReplaySpec(16.0).check_block(16)
    assert not is_replay("self:4") and not is_replay(None)


@pytest.mark.parametrize(("mean", "spread"), [(6.88, 3.0), (0.0, 0.0), (2.5, 2.5), (0.78, 0.5)])
def test_diffuser_mean_lands_close_on_short_runs(mean, spread):
    d = Diffuser(mean, spread, seed=3)
    values = []
    for _ in range(30):
        v = d.draw(15)
        d.settle(v)
        values.append(v)
    assert abs(sum(values) / len(values) - mean) <= (spread + 1) / 30
    if spread:
        assert len(set(values)) > 1  # rounds vary, as a real drafter's do


def test_diffuser_makes_up_a_clipped_draw():
    d = Diffuser(6.0, 0.0, seed=0)
    first = d.draw(2)  # only two tokens were left
    d.settle(first)
    assert first == 2 and d.draw(15) == 10  # the shortfall comes back in the next round


def test_corrupt_replaces_exactly_position_k_plus_one():
    assert corrupt([4, 5, 6], 1, 10) == [4, 6, 6]
    assert corrupt([4, 9, 6], 1, 10) == [4, 8, 6]  # the last id: its neighbour below
    assert corrupt([4, 5, 6], 3, 10) == [4, 5, 6]  # k covers it all: nothing replaced


def test_replay_blocks_follow_the_recording_and_shrink_at_its_end():
    spec = ReplaySpec(4.0, 0.5)
    prompt, out = [1, 2, 3], list(range(10, 30))
    rep = Replay(prompt, out, spec, max_drafts=7, vocab_size=100)
    n = len(prompt) + 1
    planned = rep.after([*prompt, *out[:1]])
    assert len(planned.tokens) == 7 and planned.tokens[: planned.k] == out[1 : 1 + planned.k]
    if planned.k < 7:
        assert planned.tokens[planned.k] != out[1 + planned.k]
    assert rep.outcome(n, planned, None) == (planned.k, out[1 + planned.k])
    assert rep.outcome(n, planned, 0) == (0, out[1])  # only the anchor verified
    tail = rep.block(len(prompt) + 18)
    assert len(tail.tokens) == 2 and tail.k <= 2
    assert rep.block(len(prompt) + 20).tokens == []  # the recording is over


def test_replay_stops_drafting_once_the_text_leaves_the_recording():
    rep = Replay([1, 2], [5, 6, 7, 8], ReplaySpec(3.0), max_drafts=3, vocab_size=50)
    assert rep.follows([1, 2, 5])
    assert rep.after([1, 2, 5, 9]).tokens == []
    assert rep.after([1, 2, 5, 6]).tokens == []  # for good


def test_decoys_are_never_the_true_outcome():
    for k, r, top in [(0, 5, 0), (3, 7, 15), (15, -1, 15), (2, 99, 4)]:
        out = decoys(k, r, top, 16, 100)
        assert (k, r) not in out and len(out) == len(set(out)) == 16
        assert all(0 <= j <= top for j, _ in out)
    assert decoys(3, 7, 15, 3, 100)[:2] == [(2, 10), (4, 12)]  # nearest positions first


def test_book_keeps_the_longest_greedy_recording_and_finds_by_prefix():
    book, greedy = ReplayBook(), SamplingConfig()
    book.record([1, 2], greedy, [3, 4])
    book.record([1, 2], SamplingConfig(seed=7), [3, 4, 5])  # the seed does not change greedy
    book.record([1, 2], greedy, [3])
    book.record([1, 2], SamplingConfig(temperature=1.0), [9, 9, 9, 9])  # sampled: not kept
    assert book.get([1, 2], greedy) == [3, 4, 5] and len(book) == 1
    assert book.get([1, 2], SamplingConfig(repetition_penalty=1.2)) is None
    book.record([1], greedy, [2, 3, 4, 5, 6])
    assert book.find([1, 2, 3], greedy) == ([1, 2], [3, 4, 5])  # the longest prompt
    assert book.find([1, 2, 4], greedy) == ([1, 2], [3, 4, 5])  # off both: the longest
    assert book.find([1, 3], greedy) == ([1], [2, 3, 4, 5, 6])  # off every one: by prompt
    assert book.find([2, 1], greedy) is None
    assert book.find([1, 2, 3, 4, 5, 6], greedy) == ([1], [2, 3, 4, 5, 6])
