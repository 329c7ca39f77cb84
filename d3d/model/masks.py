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


def extend_block_mask(
    prefix_len: int, new_len: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """T new committed tokens (causal) followed by one draft block, after S cached tokens.

    Lets the drafter catch its cache up with the accepted tokens and draft the next block in a
    single forward: the new tokens see the cache and each other causally, never the block; the
    block sees everything before it and all of its own slots. Returns bool [1, 1, T+B, S+T+B].
    """
    t, b = new_len, block_size
    new_rows = torch.cat(
        [
            causal_mask(prefix_len, t, device)[0, 0],
            torch.zeros(t, b, dtype=torch.bool, device=device),
        ],
        dim=1,
    )
    block_rows = torch.ones(b, prefix_len + t + b, dtype=torch.bool, device=device)
    return torch.cat([new_rows, block_rows], dim=0).unsqueeze(0).unsqueeze(0)


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


def packed_block_mask(
    clean_len: int,
    anchors: list[int],
    block_size: int,
    clean_queries: bool = True,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Mask for clean tokens followed by many draft blocks, in one forward (training, scoring).

    Keys are the L clean tokens then n blocks of B slots. Clean queries (when included) are
    causal over the clean tokens and see no block. Block i, anchored at clean position s_i, sees
    the clean tokens at positions < s_i and every slot of its own block — exactly what it sees
    when drafting after a cache of x_0..x_{s_i-1}; it never sees another block.
    Returns bool [1, 1, Q, L + n*B] with Q = L + n*B (or n*B without clean queries).
    """
    n, b = len(anchors), block_size
    s = torch.tensor(anchors, dtype=torch.long, device=device)
    if n and (int(s.min()) < 0 or int(s.max()) >= clean_len):
        raise ValueError(f"anchors must lie in [0, {clean_len}), got {anchors}")
    block_of = torch.arange(n, device=device).repeat_interleave(b)  # [n*B]
    k_clean = torch.arange(clean_len, device=device)
    blocks_clean = k_clean.unsqueeze(0) < s[block_of].unsqueeze(1)  # [n*B, L]
    blocks_blocks = block_of.unsqueeze(1) == block_of.unsqueeze(0)  # [n*B, n*B]
    rows = torch.cat([blocks_clean, blocks_blocks], dim=1)
    if clean_queries:
        clean = torch.cat(
            [
                k_clean.unsqueeze(0) <= k_clean.unsqueeze(1),
                torch.zeros(clean_len, n * b, dtype=torch.bool, device=device),
            ],
            dim=1,
        )
        rows = torch.cat([clean, rows], dim=0)
    return rows.unsqueeze(0).unsqueeze(0)


def packed_block_positions(
    clean_len: int,
    anchors: list[int],
    block_size: int,
    clean_queries: bool = True,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Position ids [1, Q] for :func:`packed_block_mask`: clean 0..L-1, block i s_i..s_i+B-1."""
    s = torch.tensor(anchors, dtype=torch.long, device=device)
    blocks = (s.unsqueeze(1) + torch.arange(block_size, device=device)).reshape(-1)
    parts = [torch.arange(clean_len, device=device), blocks] if clean_queries else [blocks]
    return torch.cat(parts).unsqueeze(0)


def branch_mask(
    visible: list[int],
    cached_len: int,
    block_size: int,
    chain_len: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Mask for C chain tokens and n draft blocks (one per branch) after a cache, in one forward.

    The chain (the draft being verified, appended to the drafter's cache) is causal over the
    cache and itself and sees no block. Branch b's block sees the first ``visible[b]`` positions
    of cache + chain (the committed prefix plus the part of the draft that branch assumes
    accepted) and every slot of its own block; never another block, never positions beyond its
    own outcome. Returns bool [1, 1, C + n*B, S + C + n*B] with S = ``cached_len``.
    """
    n, b, c = len(visible), block_size, chain_len
    v = torch.tensor(visible, dtype=torch.long, device=device)
    if n and (int(v.min()) < 0 or int(v.max()) > cached_len + c):
        raise ValueError(f"visible lengths must lie in [0, {cached_len + c}], got {visible}")
    chain_rows = torch.cat(
        [
            causal_mask(cached_len, c, device)[0, 0],
            torch.zeros(c, n * b, dtype=torch.bool, device=device),
        ],
        dim=1,
    )
    block_of = torch.arange(n, device=device).repeat_interleave(b)  # [n*B]
    keys = torch.arange(cached_len + c, device=device).unsqueeze(0)
    block_rows = torch.cat(
        [keys < v[block_of].unsqueeze(1), block_of.unsqueeze(1) == block_of.unsqueeze(0)], dim=1
    )
    return torch.cat([chain_rows, block_rows], dim=0).unsqueeze(0).unsqueeze(0)


def branch_positions(
    visible: list[int],
    block_size: int,
    cached_len: int = 0,
    chain_len: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Position ids [1, C + n*B]: the chain continues the cache; branch b's block starts right
    after its visible prefix."""
    v = torch.tensor(visible, dtype=torch.long, device=device)
    chain = torch.arange(cached_len, cached_len + chain_len, device=device)
    blocks = (v.unsqueeze(1) + torch.arange(block_size, device=device)).reshape(-1)
    return torch.cat([chain, blocks]).unsqueeze(0)
