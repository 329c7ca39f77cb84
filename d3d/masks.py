"""Pure builders of attention masks and position ids.

All masks here are boolean ``[1, 1, Q, KV]`` tensors where ``True`` means "query may attend to
key". The KV axis is the cached prefix (length S) followed by the new queries themselves, which
is how Hugging Face models lay out keys when a cache is passed. :func:`to_model_mask` turns a
boolean mask into what a given attention implementation expects (sdpa takes booleans, eager an
additive float mask).

Letters: S cached length, K draft length, B block size (= K + 1), Q queries.
"""

from __future__ import annotations

import torch


def block_mask(
    prefix_len: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Mask for one draft block ``[anchor, MASK x (B-1)]`` appended to a cached prefix.

    Every block slot sees the whole prefix and every slot of its own block (bidirectional).
    Returns bool [1, 1, B, S + B].
    """
    return torch.ones(1, 1, block_size, prefix_len + block_size, dtype=torch.bool, device=device)


def block_positions(
    prefix_len: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Position ids [1, B] of a block that starts right after a prefix of length S."""
    return torch.arange(prefix_len, prefix_len + block_size, device=device).unsqueeze(0)


def causal_mask(prefix_len: int, new_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Ordinary causal mask for T new tokens after S cached ones: bool [1, 1, T, S + T]."""
    q = torch.arange(new_len, device=device).unsqueeze(1) + prefix_len
    k = torch.arange(prefix_len + new_len, device=device).unsqueeze(0)
    return (k <= q).unsqueeze(0).unsqueeze(0)


def to_model_mask(mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """Convert a boolean mask for the model's attention implementation.

    sdpa and flex take the boolean mask as is; eager adds the mask to the scores, so it needs
    0 where allowed and the dtype's minimum where blocked.
    """
    if attn_implementation in ("sdpa", "flex_attention"):
        return mask
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, torch.finfo(dtype).min)
