"""Masks and position ids: a block sees the prefix and its own block, nothing after."""

import torch

from d3d.model import masks


def test_block_mask_sees_prefix_and_own_block():
    m = masks.block_mask(prefix_len=5, block_size=4)
    assert m.shape == (1, 1, 4, 9)
    assert m.dtype == torch.bool
    assert m.all(), "every slot sees the whole prefix and every slot of its block"


def test_block_positions_continue_after_prefix():
    assert masks.block_positions(5, 4).tolist() == [[5, 6, 7, 8]]
    assert masks.block_positions(0, 3).tolist() == [[0, 1, 2]]


def test_causal_mask_after_prefix():
    m = masks.causal_mask(prefix_len=2, new_len=3)[0, 0]
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)


def test_to_model_mask_sdpa_keeps_bool_and_eager_is_additive():
    m = masks.causal_mask(1, 2)
    assert masks.to_model_mask(m, "sdpa", torch.float32) is m
    add = masks.to_model_mask(m, "eager", torch.float32)
    assert add.dtype == torch.float32
    assert (add[m] == 0).all()
    assert (add[~m] == torch.finfo(torch.float32).min).all()


def test_extend_block_mask_new_tokens_are_causal_and_blind_to_the_block():
    m = masks.extend_block_mask(prefix_len=2, new_len=2, block_size=3)[0, 0]
    assert m.shape == (5, 7)
    new = m[:2]
    assert torch.equal(new[:, :4], masks.causal_mask(2, 2)[0, 0])
    assert not new[:, 4:].any(), "committed tokens never see the draft block"
    assert m[2:].all(), "the block sees the prefix, the new tokens and all of its own slots"
    assert torch.equal(masks.extend_block_mask(4, 0, 3), masks.block_mask(4, 3))
