"""Drafter training objectives, computed in one packed forward per sequence.

Design (DESIGN.md §2):

- *Masked-block prediction.* Sample anchors s in the response; each block ``[x_s, MASK x (B-1)]``
  sits at positions s..s+B-1, sees the clean tokens before s and its own block, and slot j is
  trained to predict x_{s+j+1} — the same convention the drafter uses at inference, so the
  packed forward gives exactly the logits :class:`d3d.model.drafter.DraftSession` would. Slot j is
  draft position k = j+1 and weighs w_k = exp(-(k-1)/gamma) (earlier positions matter more,
  since verification stops at the first miss); ``gamma=None`` weighs all positions equally.
- *Next-token prediction* on the clean stream (the response tokens), weight ``ntp_weight``,
  keeps the drafter a good causal LM, which is what fills its prefix cache.
- Both share one forward: clean tokens first (causal), then all blocks, with the mask from
  :func:`d3d.model.masks.packed_block_mask`. The LM head runs only on the rows that carry a loss,
  since over a 49k vocabulary it costs as much as a few layers.
- *Adapter drafters* (frozen target layers, adapters at mask slots) take a cheaper path,
  :func:`cached_prefix_forward`: their clean rows and anchors compute the frozen target, so the
  clean sequence runs once without gradients into a KV cache, and only the mask slots (n x K
  rows, anchors dropped: an anchor's KV is the clean token's) run with gradients. Slot 0 (the
  anchor's own prediction) is the frozen model's and carries no loss; next-token prediction has
  nothing to train.
- *Soft labels* (``kl_weight`` > 0): a top-k of the target's distribution at each labelled
  position, trained with a soft cross-entropy (KL up to a constant) beside the hard-label CE.
  When the drafter's clean pass *is* the target (all of its layers, adapters), the teacher's
  logits come from that pass for free.

Pure functions take tensors; :func:`packed_forward` and :func:`drafter_loss` run the model.
Letters: L clean length, n blocks, B block size, K = B-1 drafts, V vocab, H hidden.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from d3d.model import masks
from d3d.model.drafter import IGNORE_LABEL, D3DDrafter

IGNORE = IGNORE_LABEL


@dataclass(frozen=True)
class LossConfig:
    """Weights of the two objectives and how many blocks each sequence contributes."""

    gamma: float | None = 5.0
    ntp_weight: float = 0.5
    anchors_per_seq: int = 16
    kl_weight: float = 0.0
    topk: int = 8

    def __post_init__(self) -> None:
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma: must be > 0 (or None for uniform), got {self.gamma}")
        if self.ntp_weight < 0:
            raise ValueError(f"ntp_weight: must be >= 0, got {self.ntp_weight}")
        if self.anchors_per_seq < 1:
            raise ValueError(f"anchors_per_seq: must be >= 1, got {self.anchors_per_seq}")
        if self.kl_weight < 0 or self.topk < 1:
            raise ValueError(
                f"kl_weight must be >= 0 and topk >= 1, got {self.kl_weight}, {self.topk}"
            )


@dataclass(frozen=True)
class Packed:
    """One sequence laid out for the packed forward.

    ``ids`` [L] clean tokens; ``anchors`` n positions; ``block_labels`` [n, K];
    ``ntp_start``: clean positions t >= ntp_start predict ids[t+1] in the next-token loss.
    """

    ids: torch.Tensor
    anchors: list[int]
    block_labels: torch.Tensor
    ntp_start: int
    teacher_forced: bool = False  # labels are the teacher's argmax, not ids (text records)
    soft: tuple[torch.Tensor, torch.Tensor] | None = None  # stored top-k: ids, log-probs [n, K, k]


@dataclass(frozen=True)
class LossParts:
    """The total loss (with grad) and its two parts (floats, for logging)."""

    total: torch.Tensor
    block: float
    ntp: float


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for draft positions k = 1..B-1 (ones when gamma is None): [K]."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    if gamma is None:
        return torch.ones_like(k)
    return torch.exp(-(k - 1) / gamma)


def block_labels(ids: torch.Tensor, anchors: Sequence[int], block_size: int) -> torch.Tensor:
    """Targets of each block's slots: slot j of the block at s predicts ids[s+j+1]: [n, K].

    Slots past the end of the sequence get ``IGNORE``.
    """
    idx = torch.tensor(list(anchors), dtype=torch.long).unsqueeze(1) + torch.arange(1, block_size)
    valid = idx < ids.shape[0]
    out = torch.full(idx.shape, IGNORE, dtype=torch.long)
    out[valid] = ids.cpu()[idx[valid]]
    return out


def sample_anchors(lo: int, hi: int, n: int, generator: torch.Generator) -> list[int]:
    """n distinct anchors in [lo, hi] (all of them when fewer exist), sorted."""
    if hi < lo:
        return []
    count = hi - lo + 1
    if count <= n:
        return list(range(lo, hi + 1))
    pick = torch.randperm(count, generator=generator)[:n]
    return sorted(int(i) + lo for i in pick)


def pack(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    n_anchors: int,
    block_size: int,
    generator: torch.Generator,
    max_len: int | None = None,
    topk: tuple[Sequence, Sequence] | None = None,
) -> Packed | None:
    """Lay out one training sequence: a window of prompt + response and sampled anchors.

    A sequence longer than ``max_len`` keeps a random window that ends inside the response,
    dropping the oldest tokens (RoPE only sees relative positions). Anchors lie on response
    tokens that still have a next token. Returns None when there is nothing to train on.
    ``topk``: the target's stored top-k (ids, log-probs) for each response token, which become
    the soft labels of the block slots that predict those tokens.
    """
    ids = list(prompt_ids) + list(response_ids)
    p0 = p = len(prompt_ids)
    start = 0
    if max_len is not None and len(ids) > max_len:
        lo_end = max(max_len, p + 2)
        if lo_end > len(ids):
            return None
        end = int(torch.randint(lo_end, len(ids) + 1, (1,), generator=generator))
        start = end - max_len
        ids, p = ids[start:end], max(p - start, 1)
    anchors = sample_anchors(p, len(ids) - 2, n_anchors, generator)
    if not anchors:
        return None
    x = torch.tensor(ids, dtype=torch.long)
    soft = None if topk is None else stored_soft_labels(topk, anchors, block_size, start - p0)
    return Packed(x, anchors, block_labels(x, anchors, block_size), ntp_start=p - 1, soft=soft)


def stored_soft_labels(
    topk: tuple[Sequence, Sequence], anchors: Sequence[int], block_size: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored top-k of the tokens the block slots predict: ids and log-probs [n, K, k].

    Slot j of the block at window position s predicts window position s+j+1, which is response
    token s+j+1+``offset``; slots without a stored entry get ``IGNORE`` ids.
    """
    ids, logp = topk
    k = len(ids[0]) if len(ids) else 1
    r = torch.tensor(list(anchors)).unsqueeze(1) + torch.arange(1, block_size) + offset
    valid = (r >= 0) & (r < len(ids))
    out_ids = torch.full((*r.shape, k), IGNORE, dtype=torch.long)
    out_logp = torch.zeros((*r.shape, k))
    if len(ids):
        out_ids[valid] = torch.tensor(ids, dtype=torch.long)[r[valid]]
        out_logp[valid] = torch.tensor(logp, dtype=torch.float32)[r[valid]]
    return out_ids, out_logp


def weighted_block_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Position-weighted cross-entropy: logits [n, K, V], labels [n, K], weights [K] -> scalar.

    sum_{i,k} w_k CE_ik / sum_{i,k} w_k over the slots that have a label.
    """
    n, k, v = logits.shape
    ce = F.cross_entropy(
        logits.reshape(n * k, v).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="none"
    ).view(n, k)
    w = weights.to(ce.device).unsqueeze(0) * (labels != IGNORE).to(ce.device)
    return (ce * w).sum() / w.sum().clamp_min(1e-8)


@dataclass(frozen=True)
class PackedOutput:
    """``block`` logits [n, K, V]; ``clean`` logits [T, V] for positions ntp_start..L-2 or None;
    ``soft``: the teacher's top-k (ids [n, K, k] target ids, log-probs [n, K, k]) or None."""

    block: torch.Tensor
    clean: torch.Tensor | None
    soft: tuple[torch.Tensor, torch.Tensor] | None = None


def soft_cross_entropy(
    logits: torch.Tensor, soft_ids: torch.Tensor, soft_logp: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Position-weighted -sum_k p_k log q(t_k) against a renormalised teacher top-k.

    logits [n, K, V_d] (draft space), soft_ids [n, K, k] draft-space ids (``IGNORE``: outside
    the draft vocabulary or no label), soft_logp [n, K, k] teacher log-probs, weights [K].
    """
    valid = soft_ids != IGNORE
    p = torch.where(valid, soft_logp.float().exp(), torch.zeros_like(soft_logp, dtype=torch.float))
    mass = p.sum(-1, keepdim=True)
    p = p / mass.clamp_min(1e-8)
    logq = torch.log_softmax(logits.float(), dim=-1)
    picked = logq.gather(-1, soft_ids.clamp_min(0).to(logq.device))
    ce = -(p.to(logq.device) * picked).sum(-1)  # [n, K]
    w = weights.to(ce.device).unsqueeze(0) * (mass.squeeze(-1) > 0).to(ce.device)
    return (ce * w).sum() / w.sum().clamp_min(1e-8)


def cached_prefix_forward(drafter: D3DDrafter, packed: Packed, topk: int = 0) -> PackedOutput:
    """Block logits of an adapter drafter: clean pass without gradients, then mask slots only.

    The n blocks' K mask slots (positions s+1..s+K, after anchor s) attend to the cached clean
    keys up to s — the anchor's KV is the clean token's — and to their own block; slot 0's
    logits are the clean pass's at s. With ``topk`` and a drafter whose clean pass is the
    target, the teacher's top-k at the labelled positions comes with it.
    """
    dev, b = drafter.device, drafter.block_size
    k, n, big_l = b - 1, len(packed.anchors), packed.ids.shape[0]
    ids = packed.ids.to(dev)
    cache = DynamicCache()
    with torch.no_grad():
        pos = torch.arange(big_l, device=dev).unsqueeze(0)
        emb = drafter.lm.get_input_embeddings()(ids).unsqueeze(0)
        h_clean = drafter.body(emb, pos, None, cache)[0]  # [L, H], the frozen model
    starts = [s + 1 for s in packed.anchors]  # the mask run of block i starts after its anchor
    mask = masks.packed_block_mask(big_l, starts, k, clean_queries=False, device=dev)
    mask = masks.to_model_mask(mask, drafter.lm.config._attn_implementation, emb.dtype)
    pos = masks.packed_block_positions(big_l, starts, k, clean_queries=False, device=dev)
    embeds = drafter.mask_embedding.to(emb.dtype).view(1, 1, -1).expand(1, n * k, -1)
    slots = torch.ones(n * k, dtype=torch.bool, device=dev)
    h = drafter.body(embeds, pos, mask, cache, slots)[0].view(n, k, -1)
    anchors = torch.tensor(packed.anchors, device=dev)
    first = drafter.head(h_clean[anchors]).unsqueeze(1)  # [n, 1, V_d]
    block = torch.cat([first, drafter.head(h[:, : k - 1])], dim=1)  # [n, K, V_d]
    soft = packed.soft
    if topk and drafter.exact_prefix:
        with torch.no_grad():
            rows = (anchors.unsqueeze(1) + torch.arange(k, device=dev)).clamp_max(big_l - 1)
            teacher = drafter.lm.get_output_embeddings()(h_clean[rows]).float()  # [n, K, V]
            top = torch.log_softmax(teacher, dim=-1).topk(topk, dim=-1)
        soft = (top.indices, top.values)
    return PackedOutput(block, None, soft)


def packed_forward(drafter: D3DDrafter, packed: Packed, with_clean: bool) -> PackedOutput:
    """One forward of clean tokens + blocks; the LM head runs only on rows with a loss."""
    lm, dev = drafter.lm, drafter.device
    big_l, b, n = packed.ids.shape[0], drafter.block_size, len(packed.anchors)
    ids = packed.ids.to(dev)
    clean_emb = lm.get_input_embeddings()(ids)  # [L, H]
    blocks = drafter.block_embeds(ids[packed.anchors])  # [n, B, H]
    embeds = torch.cat([clean_emb, blocks.reshape(n * b, -1).to(clean_emb.dtype)]).unsqueeze(0)
    mask = masks.packed_block_mask(big_l, packed.anchors, b, device=dev)
    mask = masks.to_model_mask(mask, lm.config._attn_implementation, embeds.dtype)
    pos = masks.packed_block_positions(big_l, packed.anchors, b, device=dev)
    slots = torch.ones(big_l + n * b, dtype=torch.bool, device=dev)
    slots[:big_l] = False
    slots[big_l::b] = False  # each block's anchor slot holds a real token
    h = drafter.body(embeds, pos, mask, None, slots)[0]
    block_logits = drafter.head(h[big_l:].view(n, b, -1)[:, : b - 1])
    clean = drafter.head(h[packed.ntp_start : big_l - 1]) if with_clean else None
    return PackedOutput(block_logits, clean, packed.soft)


def drafter_loss(drafter: D3DDrafter, packed: Packed, cfg: LossConfig) -> LossParts:
    """L = L_block + ntp_weight * L_ntp (+ kl_weight * L_soft) for one packed sequence."""
    adapter = drafter.adapters is not None
    if packed.teacher_forced and not drafter.exact_prefix:
        raise ValueError(
            "teacher-forced records need a drafter whose clean pass is the target (lora:N over "
            "all of its layers): their labels are the target's own predictions"
        )
    if adapter:
        topk = cfg.topk if cfg.kl_weight > 0 or packed.teacher_forced else 0
        out = cached_prefix_forward(drafter, packed, topk)
    else:
        out = packed_forward(drafter, packed, with_clean=cfg.ntp_weight > 0)
    w = position_weights(drafter.block_size, cfg.gamma)
    labels = drafter.to_draft_labels(packed.block_labels).to(out.block.device)
    if packed.teacher_forced and out.soft is not None:
        argmax = drafter.to_draft_labels(out.soft[0][..., 0]).to(labels.device)
        labels = torch.where(labels == IGNORE, labels, argmax)
    if adapter:
        labels[:, 0] = IGNORE  # the anchor's prediction is the frozen model's
    block = weighted_block_loss(out.block, labels, w)
    total, ntp_value = block, math.nan
    if out.soft is not None and cfg.kl_weight > 0:
        soft_ids = drafter.to_draft_labels(out.soft[0].to(labels.device))
        soft_ids[labels == IGNORE] = IGNORE  # past the end, or the frozen anchor slot
        total = total + cfg.kl_weight * soft_cross_entropy(out.block, soft_ids, out.soft[1], w)
    labels = drafter.to_draft_labels(packed.ids[packed.ntp_start + 1 :])
    if out.clean is not None and bool((labels != IGNORE).any()):
        ntp = F.cross_entropy(out.clean.float(), labels.to(out.clean.device), ignore_index=IGNORE)
        total = total + cfg.ntp_weight * ntp
        ntp_value = float(ntp.detach())
    return LossParts(total=total, block=float(block.detach()), ntp=ntp_value)
