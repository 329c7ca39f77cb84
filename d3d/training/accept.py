"""Offline acceptance length of a drafter against a greedy target's own responses.

Design: when the target decodes greedily, the committed sequence *is* its greedy response, so
the online rounds can be replayed without the target. For a response x and an anchor s, the
drafter's block argmax d_1..d_K is accepted up to the first k with d_k != x_{s+k}; the round
then emits that prefix plus the target's token. Two ways to choose anchors:

- ``rounds``: start at the first response token and jump to s + a + 1 after a round that
  accepted a drafts — exactly the rounds online greedy decoding would make, so the figure
  matches ``d3d drafter-eval`` up to float noise (and batched-generation noise in the data).
- ``stride``: every ``stride``-th response position — cheaper and smoother, used for the
  validation figure during training and for layer pruning.

Block predictions come from the drafter's own cache path: the clean sequence is encoded once,
then blocks are scored in chunks, each seeing only the clean prefix before its anchor.
Letters: L clean length, n blocks, B block size, K = B-1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from d3d.backends.hf import trim_cache
from d3d.model import masks
from d3d.model.drafter import D3DDrafter
from d3d.training.objectives import IGNORE, block_labels


@dataclass(frozen=True)
class Acceptance:
    """Mean tokens per round (bonus included), and the share of rounds accepting >= k drafts."""

    acceptance_length: float
    per_position: list[float] = field(default_factory=list)
    num_rounds: int = 0
    by_source: dict[str, Acceptance] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_per_position": [round(p, 4) for p in self.per_position],
            "num_rounds": self.num_rounds,
        }
        if self.by_source:
            out["by_source"] = {
                k: {"acceptance_length": round(a.acceptance_length, 4), "num_rounds": a.num_rounds}
                for k, a in sorted(self.by_source.items())
            }
        return out


def accepted_prefix(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Leading matches of each block: pred [n, K], labels [n, K] -> [n] (``IGNORE`` stops)."""
    hit = (pred == labels) & (labels != IGNORE)
    return hit.long().cumprod(dim=1).sum(dim=1)


def summarize(accepted: Sequence[int], k: int) -> Acceptance:
    """Acceptance from the per-round accepted counts."""
    if not accepted:
        return Acceptance(1.0, [0.0] * k, 0)
    a = torch.tensor(list(accepted), dtype=torch.float32)
    per = [float((a >= j).float().mean()) for j in range(1, k + 1)]
    return Acceptance(float(1 + a.mean()), per, len(accepted))


@torch.inference_mode()
def block_predictions(
    drafter: D3DDrafter, ids: torch.Tensor, anchors: Sequence[int], chunk: int = 32
) -> torch.Tensor:
    """Block argmax for each anchor over the clean sequence ids [L]: [n, K]."""
    b, dev, lm = drafter.block_size, drafter.device, drafter.lm
    big_l = int(ids.shape[0])
    cache = DynamicCache()
    drafter.encode(ids.tolist(), cache)
    out = []
    for i in range(0, len(anchors), chunk):
        part = list(anchors[i : i + chunk])
        embeds = drafter.block_embeds(ids[part].to(dev)).reshape(1, len(part) * b, -1)
        mask = masks.packed_block_mask(big_l, part, b, clean_queries=False, device=dev)
        mask = masks.to_model_mask(mask, lm.config._attn_implementation, embeds.dtype)
        pos = masks.packed_block_positions(big_l, part, b, clean_queries=False, device=dev)
        slots = torch.ones(len(part) * b, dtype=torch.bool, device=dev)
        slots[::b] = False  # anchors hold real tokens
        h = drafter.body(embeds, pos, mask, cache, slots)
        trim_cache(cache, len(part) * b)
        rows = h[0].view(len(part), b, -1)[:, : b - 1]
        out.append(drafter.to_target_ids(drafter.head(rows).argmax(dim=-1)).cpu())
    return torch.cat(out) if out else torch.zeros(0, b - 1, dtype=torch.long)


def replay_rounds(accepted_at: dict[int, int], start: int, end: int) -> list[int]:
    """Follow greedy rounds: from anchor ``start``, a round accepting a jumps to s + a + 1;
    stops once the anchor passes ``end`` (the last anchor with a next token)."""
    out, s = [], start
    while s <= end:
        a = accepted_at[s]
        out.append(a)
        s += a + 1
    return out


@torch.inference_mode()
def offline_acceptance(
    drafter: D3DDrafter,
    records: Sequence[dict],
    mode: str = "rounds",
    stride: int = 4,
    max_response: int | None = None,
) -> Acceptance:
    """Acceptance length over records with ``prompt_ids`` and ``response_ids`` (see above),
    also per ``source`` when records name one."""
    if mode not in ("rounds", "stride"):
        raise ValueError(f"mode: must be rounds or stride, got {mode!r}")
    b = drafter.block_size
    accepted: list[int] = []
    per_source: dict[str, list[int]] = {}
    for rec in records:
        resp = list(rec["response_ids"])[:max_response] if max_response else rec["response_ids"]
        if len(resp) < 2:
            continue
        ids = torch.tensor(list(rec["prompt_ids"]) + list(resp), dtype=torch.long)
        p, end = len(rec["prompt_ids"]), ids.shape[0] - 2
        anchors = list(range(p, end + 1, 1 if mode == "rounds" else stride))
        pred = block_predictions(drafter, ids, anchors)
        counts = accepted_prefix(pred, block_labels(ids, anchors, b)).tolist()
        if mode == "rounds":
            counts = replay_rounds(dict(zip(anchors, counts, strict=True)), p, end)
        accepted += counts
        if "source" in rec:
            per_source.setdefault(str(rec["source"]), []).extend(counts)
    total = summarize(accepted, b - 1)
    groups = {k: summarize(v, b - 1) for k, v in per_source.items()}
    return dataclasses.replace(total, by_source=groups)
