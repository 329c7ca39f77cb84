"""Context lookup: which copy is found, and when a copy round is judged to pay."""

import numpy as np
import pytest
import torch

from d3d.decoding.lookup import BUCKETS, CopyCosts, CopyDrafts, find_copy, one_hot_q


def test_the_longest_match_wins_over_a_later_shorter_one():
    #           0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 8, 9, 1, 7, 2, 3, 5, 6, 7]
    c = find_copy(tokens, 3)
    # "5 6 7" matches at 0..2 (3 tokens); "7" alone also matches at 6, later but shorter.
    assert c is not None and c.ngram == 3 and c.source == 3 and c.tokens == (8, 9, 1)


def test_the_latest_of_equally_long_matches_wins():
    tokens = [4, 9, 1, 4, 9, 2, 4, 9]
    c = find_copy(tokens, 2)
    assert c is not None and c.ngram == 2 and c.tokens == (2, 4)


def test_a_copy_stops_at_k_and_at_the_end_of_the_text():
    assert find_copy([1, 2, 3, 4, 1], 2).tokens == (2, 3)
    assert find_copy([1, 2, 3, 4, 1], 10).tokens == (2, 3, 4, 1)
    # The match may run into the very tokens being matched (a repeated run).
    assert find_copy([7, 7, 7], 4).tokens == (7,)


def test_no_copy_without_an_earlier_match_or_below_min_ngram():
    assert find_copy([1, 2, 3], 4) is None
    assert find_copy([], 4) is None
    assert find_copy([5], 4) is None
    assert find_copy([1, 2, 9, 2], 4, min_ngram=2) is None
    assert find_copy([1, 2, 9, 1, 2], 4, min_ngram=2).tokens == (9, 1, 2)


def test_max_ngram_caps_the_match_length():
    tokens = list(range(10)) + list(range(10))
    c = find_copy(tokens, 3, max_ngram=4)
    assert c.ngram == 4 and c.tokens == (0, 1, 2)


def test_numpy_input_and_bad_arguments():
    assert find_copy(np.array([3, 1, 3]), 1).tokens == (1,)
    with pytest.raises(ValueError):
        find_copy([1, 2], 0)
    with pytest.raises(ValueError):
        find_copy([1, 2], 1, max_ngram=1, min_ngram=2)


def test_one_hot_q_puts_all_mass_on_the_draft():
    q = one_hot_q(torch.tensor([2, 0, 4]), 5)
    assert q.shape == (3, 5) and torch.equal(q.sum(1), torch.ones(3))
    assert q[0, 2] == q[1, 0] == q[2, 4] == 1.0


def _drafts(**kw) -> CopyDrafts:
    return CopyDrafts(CopyCosts(), max_len=15, vocab_size=50, **kw)


def test_no_copy_before_a_plain_step_was_measured_and_q_only_when_sampling():
    d = _drafts()
    tokens = [1, 2, 3, 9, 1, 2]
    assert d.propose(tokens, None, True) is None
    greedy = d.propose(tokens, 0.05, True)
    assert greedy is not None and greedy.q is None and greedy.tokens.tolist() == [3, 9, 1, 2]
    assert greedy.bucket == 1  # a two-token match
    sampled = d.propose(tokens, 0.05, False)
    assert sampled.q is not None and sampled.q.shape == (4, 50)


def test_a_bucket_is_explored_then_judged_and_retried_now_and_then():
    d = _drafts(explore=2, retry_every=3)
    tokens = [8, 1, 2, 3, 9, 1]  # a one-token match: bucket 0
    step = 0.1
    for _ in range(2):  # exploring: copies are proposed whatever they achieved
        c = d.propose(tokens, step, True)
        assert c is not None and c.bucket == 0
        d.record(c, emitted=1, verify_s=0.2)  # one token for two steps' time: a loss
    assert d.propose(tokens, step, True) is None
    assert d.propose(tokens, step, True) is None
    again = d.propose(tokens, step, True)  # the third declined match tries again
    assert again is not None
    d.record(again, emitted=8, verify_s=0.2)  # now it pays: 4 steps' worth a round
    # the average moved towards 8 tokens a round
    assert d.costs.tokens[0].value > 2 and d.propose(tokens, step, True) is not None


def test_buckets_are_judged_apart():
    d = _drafts(explore=1)
    costs = d.costs
    costs.tried = [1] * BUCKETS
    costs.round_s.add(0.2)
    costs.tokens[0].add(1.0)  # one-token matches lose
    costs.tokens[3].add(9.0)  # long matches pay
    assert not d.pays(0, 0.1)
    assert d.pays(3, 0.1)
