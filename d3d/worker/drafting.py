"""The drafter's forwards for asynchronous drafting: encode a draft chain, draft many branches.

After the drafter hands out a block ``d_1..d_K`` (anchored at the last committed token a), it
prepares the next round while the target verifies:

- :func:`draft_branches`, one forward: it appends as much of the chain ``[a, d_1..d_m]`` as the
  chosen outcomes need (m = their largest k; that part becomes committed prefix if accepted, so
  the work is not wasted) and drafts one block ``[r, MASK x K]`` per outcome (k, r): block b
  sees the cache and chain up to ``a, d_1..d_{k_b}`` and its own slots (a 4D mask from
  :func:`d3d.model.masks.branch_mask`), sits at the positions it will have if that outcome happens,
  and its KV is dropped afterwards. On this CPU a forward costs about its token count, so a
  weak drafter, whose likely outcomes are k = 0 or 1, pays for a chain of one or two tokens, not
  sixteen.
- :func:`encode_chain`: append tokens causally and read the drafter's next-token scores at the
  last of them (the first block of a request: the prompt's last token predicts the first answer
  token; the LM head runs over that row only).

All drafter forwards go through :meth:`D3DDrafter.body`, which knows the mask slots.
Letters: S cached length, K = B-1 draft length, n branches, V_d draft vocabulary, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from d3d.backends.hf import cache_length, trim_cache
from d3d.backends.ragged import KWARG, RaggedCache, Segment
from d3d.model import masks
from d3d.model.drafter import D3DDrafter


@torch.inference_mode()
def encode_chain(
    drafter: D3DDrafter, cache: DynamicCache, ids: Sequence[int], keep: int | None = None
) -> torch.Tensor:
    """Append ids [T] causally; draft-space next-token scores at the last ``keep`` of them
    (None: all): [min(keep, T), V_d].

    The LM head runs over those rows only: a prompt's first block needs the last row, and
    scores for every row of a 32k-token prompt would be ~10 GB at Qwen3's vocabulary.
    """
    s = cache_length(cache)
    x = torch.tensor([list(ids)], device=drafter.device)
    pos = torch.arange(s, s + x.shape[1], device=drafter.device).unsqueeze(0)
    hidden = drafter.body(drafter.lm.get_input_embeddings()(x), pos, None, cache)  # [1, T, H]
    rows = hidden[0] if keep is None else hidden[0, max(hidden.shape[1] - keep, 0) :]
    return drafter.head(rows)


@torch.inference_mode()
def draft_branches(
    drafter: D3DDrafter,
    cache: DynamicCache,
    visible: list[int],
    anchors: list[int],
    chain: Sequence[int] = (),
) -> torch.Tensor:
    """One forward: append ``chain`` [C] to the cache causally and draft a block per branch;
    draft-space scores [n, K, V_d].

    Branch b's block ``[anchors[b], MASK x K]`` sees the first ``visible[b]`` positions of
    cache + chain. Afterwards the cache holds the chain too, and no block.
    """
    n, b, c = len(anchors), drafter.block_size, len(chain)
    dev = drafter.device
    s = cache_length(cache)
    blocks = drafter.block_embeds(torch.tensor(anchors, device=dev)).reshape(1, n * b, -1)
    parts = [blocks]
    if c:
        parts.insert(0, drafter.lm.get_input_embeddings()(torch.tensor([list(chain)], device=dev)))
    embeds = torch.cat(parts, dim=1)
    mask = masks.to_model_mask(
        masks.branch_mask(visible, s, b, c, dev),
        drafter.lm.config._attn_implementation,
        embeds.dtype,
    )
    slots = torch.ones(c + n * b, dtype=torch.bool, device=dev)
    slots[:c] = False
    slots[c::b] = False  # each block's first slot holds a real token
    pos = masks.branch_positions(visible, b, s, c, dev)
    hidden = drafter.body(embeds, pos, mask, cache, slots)
    trim_cache(cache, n * b)
    return drafter.head(hidden[0, c:].view(n, b, -1)[:, : b - 1])


class _SessionKeys:
    """One session's cache seen as a row of a ragged forward (its keys read in place)."""

    def __init__(self, cache: DynamicCache):
        self.cache = cache

    def keys(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.cache.layers[layer]
        return lay.keys[:, :, :n], lay.values[:, :, :n]


class _Sessions(RaggedCache):
    """Several sessions' caches as one ``Cache`` for one ragged forward: each segment's new keys
    are appended to its own session's cache."""

    def __init__(self, caches: Sequence[DynamicCache], spans: Sequence[tuple[int, int]], layers):
        super().__init__(layers)
        self.caches, self.spans = list(caches), list(spans)
        self.past = max((cache_length(c) for c in caches), default=0)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        for cache, (q0, q1) in zip(self.caches, self.spans, strict=True):
            cache.update(key_states[:, :, q0:q1], value_states[:, :, q0:q1], layer_idx)
        return key_states, value_states


def can_batch(drafter: D3DDrafter) -> bool:
    """Whether :func:`draft_blocks` may run this drafter (its attention goes through sdpa)."""
    return getattr(drafter.lm.config, "_attn_implementation", None) == "sdpa"


@torch.inference_mode()
def draft_blocks(
    drafter: D3DDrafter, items: Sequence[tuple[DynamicCache, Sequence[int], int]]
) -> list[torch.Tensor]:
    """One block per session in ONE drafter forward: ``items[i]`` = (its cache, the committed
    tokens it has not read yet, its anchor). Each session's ``[pending, anchor, MASK x K]`` sits
    at its own positions with the mask :meth:`D3DDrafter.block_scores` uses (pending causal and
    blind to the block, the block seeing its prefix and all of its slots; with adapters, the
    anchor blind to the mask slots); afterwards each cache holds its pending tokens too, and no block. Returns the
    draft-space scores [K, V_d] of each block, exactly what ``block_scores`` gives one by one."""
    dev, b = drafter.device, drafter.block_size
    embed = drafter.lm.get_input_embeddings()
    parts, positions, slots, segments, spans, rows = [], [], [], [], [], []
    q = 0
    for cache, pending, anchor in items:
        s, t = cache_length(cache), len(pending)
        block = drafter.block_embeds(torch.tensor([anchor], device=dev))  # [1, B, H]
        if t:
            block = torch.cat([embed(torch.tensor([list(pending)], device=dev)), block], dim=1)
        mask = masks.extend_block_mask(s, t, b, dev)[0, 0]  # [T+B, S+T+B]
        gated = torch.zeros(t + b, dtype=torch.bool, device=dev)
        gated[t + 1 :] = True
        if drafter.adapters is not None:  # ungated rows blind to the slots adapters act at
            mask[:, s:] &= ~((~gated)[:, None] & gated[None, :])
        parts.append(block)
        positions.append(torch.arange(s, s + t + b, device=dev))
        slots.append(gated)
        segments.append(Segment(q, q + t + b, s, _SessionKeys(cache), mask))
        spans.append((q, q + t + b))
        rows.append(q + t)
        q += t + b
    caches = [c for c, _, _ in items]
    hidden = drafter.body(
        torch.cat(parts, dim=1),
        torch.cat(positions)[None, :],
        torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev),
        _Sessions(caches, spans, len(drafter.lm.model.layers)),
        torch.cat(slots),
        ragged={KWARG: segments},
    )
    for cache in caches:
        trim_cache(cache, b)
    return [drafter.head(hidden[0, r : r + b - 1]) for r in rows]
