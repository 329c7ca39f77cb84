"""Context lookup: which copy is found, and when a copy round is judged to pay."""

import numpy as np
import pytest
import torch

from d3d.decoding.lookup import CopyCosts, CopyDraft, CopyDrafts, find_copy, one_hot_q


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


STEP, PER_TOKEN = 0.1, 0.005  # a verify of 16 tokens: 1.75 plain steps


def test_no_copy_before_a_plain_step_was_measured_and_q_only_when_sampling():
    d = _drafts()
    tokens = [1, 2, 3, 9, 1, 2]
    assert d.propose(tokens, None, PER_TOKEN, True) is None
    greedy = d.propose(tokens, STEP, None, True)  # no verify cost known: the copy whole
    assert greedy is not None and greedy.q is None and greedy.tokens.tolist() == [3, 9, 1, 2]
    assert greedy.bucket == 1  # a two-token match
    sampled = d.propose(tokens, STEP, None, False)
    assert sampled.q is not None and sampled.q.shape == (4, 50)


def test_an_unknown_bucket_is_tried_whole_a_missing_one_shorter_a_losing_one_now_and_then():
    d = _drafts(retry_every=3)
    tokens = [8, 1, 2, 3, 9, 4, 5, 6, 7, 10, 11, 12, 1]  # a one-token match: bucket 0
    first = d.propose(tokens, STEP, PER_TOKEN, True)
    assert first is not None and first.bucket == 0
    assert len(first.tokens) == 11  # nothing known: taken for a quotation, verified whole
    d.record(first, num_accepted=0)
    shorter = d.propose(tokens, STEP, PER_TOKEN, True)
    assert shorter is not None and 1 < len(shorter.tokens) < 11  # one miss: a shorter try
    for _ in range(40):  # its first token is never accepted: a loss at every length
        d.record(first, num_accepted=0)
    assert d.propose(tokens, STEP, PER_TOKEN, True) is None
    assert d.propose(tokens, STEP, PER_TOKEN, True) is None
    again = d.propose(tokens, STEP, PER_TOKEN, True)  # the third declined match tries again
    assert again is not None and len(again.tokens) == 1  # at the cheapest length
    sampled = _drafts(retry_every=1)
    sampled.costs = d.costs
    cut = sampled.propose(tokens, STEP, PER_TOKEN, False)
    assert cut.q is not None and cut.q.shape == (len(cut.tokens), 50)


def test_the_length_follows_acceptance_and_cost():
    d = _drafts()
    tokens = [8, 1, 2, 3, 9, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 1, 2, 3]  # bucket 2
    for _ in range(30):  # quotations: accepted whole
        d.record(CopyDraft(torch.arange(15), None, 2), num_accepted=15)
    whole = d.propose(tokens, STEP, PER_TOKEN, True)
    assert whole is not None and len(whole.tokens) == 15
    d = _drafts()
    for _ in range(30):  # where only the first token is ever accepted
        d.record(CopyDraft(torch.arange(15), None, 2), num_accepted=1)
    short = d.propose(tokens, STEP, PER_TOKEN, True)
    assert short is not None and len(short.tokens) == 1  # the one that is accepted
    # an expensive verify (each token a plain step's worth) makes the same figures lose
    assert d.length(2, 15, STEP, STEP) == 0


def test_buckets_are_judged_apart():
    d = _drafts()
    for _ in range(40):
        d.record(CopyDraft(torch.arange(8), None, 0), num_accepted=0)  # one-token matches lose
        d.record(CopyDraft(torch.arange(8), None, 3), num_accepted=8)  # long matches pay
    assert d.length(0, 15, STEP, PER_TOKEN) == 0
    assert d.length(3, 15, STEP, PER_TOKEN) == 15
