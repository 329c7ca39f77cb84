"""Branch scoring: P(k, r) from the drafter's confidences, and the choice of branches."""

import math

import pytest
import torch

from d3d.model import masks
from d3d.worker.branches import choose_branches, outcome_logp


def dist_rows(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_outcome_probabilities_follow_the_formula():
    # K = 2 drafts: d_1 = 0 (confidence 0.6), d_2 = 1 (confidence 0.5); bonus row last.
    draft = torch.tensor([0, 1])
    dist = dist_rows([0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8])
    p = outcome_logp(draft, dist).exp()
    assert p[0, 0] == 0 and p[1, 1] == 0, "accepting the draft is not a stop"
    assert p[0, 1] == pytest.approx(0.3) and p[0, 2] == pytest.approx(0.1)
    assert p[1, 0] == pytest.approx(0.6 * 0.2) and p[1, 2] == pytest.approx(0.6 * 0.3)
    assert p[2].tolist() == pytest.approx([0.6 * 0.5 * x for x in (0.1, 0.1, 0.8)])
    # The outcomes partition the event space: they sum to one.
    assert float(p.sum()) == pytest.approx(1.0)


def test_choose_takes_the_most_likely_outcomes_in_order():
    draft = torch.tensor([0, 1])
    dist = dist_rows([0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8])
    got = choose_branches(draft, dist, 3)
    assert [(o.k, o.r) for o in got] == [(0, 1), (2, 2), (1, 2)]
    assert got[0].p == pytest.approx(0.3) and got[1].p == pytest.approx(0.24)
    assert choose_branches(draft, dist, 0) == []
    assert len(choose_branches(draft, dist, 100)) == 7  # every outcome with p > 0


def test_cover_takes_each_position_first():
    draft = torch.tensor([0, 1])
    # position 0 dominates: global top-3 would all be k = 0
    dist = dist_rows([0.01, 0.5, 0.49], [0.5, 0.1, 0.4], [0.3, 0.3, 0.4])
    glob = choose_branches(draft, dist, 3)
    assert [o.k for o in glob][:2] == [0, 0]
    cov = choose_branches(draft, dist, 3, cover=True)
    assert {o.k for o in cov} == {0, 1, 2}


def test_empty_draft_predicts_the_next_token():
    got = choose_branches(torch.zeros(0, dtype=torch.long), dist_rows([0.7, 0.2, 0.1]), 2)
    assert [(o.k, o.r) for o in got] == [(0, 0), (0, 1)]
    assert got[0].p == pytest.approx(0.7)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="K\\+1"):
        outcome_logp(torch.tensor([0, 1]), dist_rows([0.5, 0.5]))


def test_branch_mask_each_block_sees_its_prefix_and_itself():
    m = masks.branch_mask([3, 5], cached_len=6, block_size=2)[0, 0]
    assert m.shape == (4, 10)
    # block 0 (rows 0-1): cache positions 0..2, and its own slots (cols 6, 7)
    assert m[0].tolist() == [True] * 3 + [False] * 3 + [True, True, False, False]
    assert m[1].tolist() == m[0].tolist()
    # block 1 (rows 2-3): cache positions 0..4, its own slots (cols 8, 9)
    assert m[2].tolist() == [True] * 5 + [False] + [False, False, True, True]
    pos = masks.branch_positions([3, 5], 2)
    assert pos.tolist() == [[3, 4, 5, 6]]
    with pytest.raises(ValueError):
        masks.branch_mask([7], cached_len=6, block_size=2)


def test_probabilities_are_plain_floats():
    o = choose_branches(torch.tensor([0]), dist_rows([0.5, 0.5], [1.0, 0.0]), 1)[0]
    assert isinstance(o.p, float) and math.isfinite(o.p)


def test_branch_mask_with_a_chain_in_the_same_forward():
    # cache of 2, chain of 2 (causal), one branch that sees cache + the chain's first token
    m = masks.branch_mask([3], cached_len=2, block_size=2, chain_len=2)[0, 0]
    assert m.shape == (4, 6)
    assert m[0].tolist() == [True, True, True, False, False, False]
    assert m[1].tolist() == [True, True, True, True, False, False]
    assert m[2].tolist() == [True, True, True, False, True, True]
    pos = masks.branch_positions([3], 2, cached_len=2, chain_len=2)
    assert pos.tolist() == [[2, 3, 3, 4]]
