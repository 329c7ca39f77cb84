"""The drafter's forwards for asynchronous drafting: encode a draft chain, draft many branches.

After the drafter hands out a block ``d_1..d_K`` (anchored at the last committed token a), it
prepares the next round while the target verifies:

1. :func:`encode_chain` appends ``[a, d_1..d_K]`` to its cache causally (the part of that chain
   the target accepts becomes committed prefix, so the work is never wasted) and reads its own
   next-token distribution at every chain position, the causal view of each outcome.
2. :func:`draft_branches` drafts one block ``[r, MASK x K]`` per chosen outcome (k, r), all in one
   forward: block b sees the cache up to ``a, d_1..d_{k_b}`` and its own slots (a 4D mask from
   :func:`d3d.masks.branch_mask`), sits at the positions it will have if that outcome happens,
   and its KV is dropped afterwards.

All drafter forwards go through :meth:`D3DDrafter.body`, which knows the mask slots.
Letters: S cached length, K = B-1 draft length, n branches, V_d draft vocabulary, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from d3d import masks
from d3d.drafter import D3DDrafter
from d3d.hf import cache_length, trim_cache


@torch.inference_mode()
def encode_chain(drafter: D3DDrafter, cache: DynamicCache, ids: Sequence[int]) -> torch.Tensor:
    """Append ids [T] causally; draft-space next-token scores at each of them: [T, V_d]."""
    s = cache_length(cache)
    x = torch.tensor([list(ids)], device=drafter.device)
    pos = torch.arange(s, s + x.shape[1], device=drafter.device).unsqueeze(0)
    hidden = drafter.body(drafter.lm.get_input_embeddings()(x), pos, None, cache)
    return drafter.head(hidden[0])


@torch.inference_mode()
def draft_branches(
    drafter: D3DDrafter, cache: DynamicCache, visible: list[int], anchors: list[int]
) -> torch.Tensor:
    """One forward drafting a block per branch; draft-space scores [n, K, V_d].

    Branch b's block ``[anchors[b], MASK x K]`` sees the first ``visible[b]`` cached tokens.
    The cache is left as it was.
    """
    n, b = len(anchors), drafter.block_size
    dev = drafter.device
    s = cache_length(cache)
    embeds = drafter.block_embeds(torch.tensor(anchors, device=dev))  # [n, B, H]
    embeds = embeds.reshape(1, n * b, -1)
    mask = masks.to_model_mask(
        masks.branch_mask(visible, s, b, dev), drafter.lm.config._attn_implementation, embeds.dtype
    )
    slots = torch.ones(n * b, dtype=torch.bool, device=dev)
    slots[::b] = False  # each block's first slot holds a real token
    hidden = drafter.body(embeds, masks.branch_positions(visible, b, dev), mask, cache, slots)
    trim_cache(cache, n * b)
    return drafter.head(hidden[0].view(n, b, -1)[:, : b - 1])
