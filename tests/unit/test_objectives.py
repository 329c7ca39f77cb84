"""Pure parts of drafter training: packed masks, positions, labels, weights, losses, acceptance."""

import math

import pytest
import torch

from d3d.model import masks
from d3d.training.accept import accepted_prefix, replay_rounds, summarize
from d3d.training.objectives import (
    IGNORE,
    LossConfig,
    block_labels,
    pack,
    position_weights,
    sample_anchors,
    weighted_block_loss,
)

B = 4


def test_packed_mask_clean_part_is_causal_and_blind_to_blocks():
    m = masks.packed_block_mask(6, [2, 4], B)[0, 0]
    assert m.shape == (6 + 2 * B, 6 + 2 * B)
    assert torch.equal(m[:6, :6], torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert not m[:6, 6:].any()


@pytest.mark.parametrize("anchors", [[0], [1, 3], [0, 2, 5], [5, 5]])
def test_packed_mask_blocks_see_only_their_prefix_and_themselves(anchors):
    big_l = 6
    m = masks.packed_block_mask(big_l, anchors, B)[0, 0]
    for i, s in enumerate(anchors):
        rows = m[big_l + i * B : big_l + (i + 1) * B]
        # the clean prefix strictly before the anchor, never the anchor's own clean copy or later
        assert rows[:, :s].all()
        assert not rows[:, s:big_l].any()
        for j in range(len(anchors)):
            cols = rows[:, big_l + j * B : big_l + (j + 1) * B]
            assert cols.all() if i == j else not cols.any()


def test_packed_mask_without_clean_queries_is_the_block_rows():
    full = masks.packed_block_mask(7, [2, 6], B)
    rows = masks.packed_block_mask(7, [2, 6], B, clean_queries=False)
    assert torch.equal(rows, full[:, :, 7:])


def test_single_block_mask_matches_the_drafting_mask():
    # A block at anchor s after a cache of s tokens sees everything: the packed layout restricted
    # to keys [0, s) + its block is the same all-true mask the drafter uses online.
    s = 5
    m = masks.packed_block_mask(9, [s], B, clean_queries=False)[0, 0]
    keep = torch.cat([torch.arange(s), torch.arange(9, 9 + B)])
    assert torch.equal(m[:, keep], masks.block_mask(s, B)[0, 0])


def test_packed_mask_rejects_anchor_outside():
    with pytest.raises(ValueError, match="anchors"):
        masks.packed_block_mask(4, [4], B)


def test_packed_positions():
    pos = masks.packed_block_positions(3, [1, 2], B)
    assert pos.tolist() == [[0, 1, 2, 1, 2, 3, 4, 2, 3, 4, 5]]
    assert masks.packed_block_positions(3, [2], B, clean_queries=False).tolist() == [[2, 3, 4, 5]]


def test_position_weights_decay_and_uniform():
    w = position_weights(16, 4.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert math.isclose(float(w[4]), math.exp(-1.0), rel_tol=1e-6)
    assert (w[1:] < w[:-1]).all()
    assert torch.equal(position_weights(16, None), torch.ones(15))


def test_block_labels_shift_and_ignore_past_end():
    ids = torch.tensor([10, 11, 12, 13, 14])
    lab = block_labels(ids, [1, 3], B)
    assert lab.tolist() == [[12, 13, 14], [14, IGNORE, IGNORE]]


def test_weighted_block_loss_weights_positions():
    v = 5
    labels = torch.tensor([[1, 2, IGNORE]])
    logits = torch.zeros(1, 3, v)
    logits[0, 0, 1] = 10.0  # slot 0 right, slot 1 uniform, slot 2 ignored
    w = torch.tensor([1.0, 0.5, 0.25])
    ce1 = math.log(v)
    expected = (
        1.0 * torch.nn.functional.cross_entropy(logits[0, :1], labels[0, :1]) + 0.5 * ce1
    ) / 1.5
    assert math.isclose(
        float(weighted_block_loss(logits, labels, w)), float(expected), rel_tol=1e-5
    )


def test_sample_anchors_distinct_sorted_in_range():
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(5, 40, 8, g)
    assert a == sorted(set(a)) and len(a) == 8 and a[0] >= 5 and a[-1] <= 40
    assert sample_anchors(3, 5, 8, g) == [3, 4, 5]
    assert sample_anchors(6, 5, 8, g) == []


def test_pack_window_keeps_response_anchors():
    g = torch.Generator().manual_seed(1)
    prompt, resp = list(range(100, 130)), list(range(200, 260))
    p = pack(prompt, resp, 6, B, g, max_len=40)
    assert p is not None and p.ids.shape[0] == 40
    assert all(int(p.ids[s]) >= 200 for s in p.anchors)
    assert p.block_labels.shape == (6, B - 1)
    full = pack(prompt, resp, 6, B, g)
    assert full.ntp_start == len(prompt) - 1 and min(full.anchors) >= len(prompt)
    assert pack(prompt, [7], 6, B, g) is None


def test_loss_config_validates():
    with pytest.raises(ValueError, match="gamma"):
        LossConfig(gamma=0.0)
    with pytest.raises(ValueError, match="ntp_weight"):
        LossConfig(ntp_weight=-1)


def test_accepted_prefix_counts_leading_matches():
    pred = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3], [1, 2, 3]])
    lab = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, IGNORE]])
    assert accepted_prefix(pred, lab).tolist() == [3, 1, 0, 2]


def test_replay_rounds_jumps_past_accepted_and_bonus():
    acc = {s: 2 for s in range(10)}
    assert replay_rounds(acc, 0, 9) == [2, 2, 2, 2]  # anchors 0, 3, 6, 9


def test_summarize_acceptance():
    r = summarize([0, 2, 4], 4)
    assert math.isclose(r.acceptance_length, 3.0)
    assert r.per_position == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert summarize([], 3).acceptance_length == 1.0
