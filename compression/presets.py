"""Which reader and which scorer for a target and its drafter: the measured choices.

- The attention reader's preset (:func:`attention_preset`): for the embedded SmolLM2-135M, one
  retrieval head of the target's first 8 layers, int8, in 1,024-token windows (calibrated in
  docs/longbench.md); for other targets, the whole drafter.
- The scorer ``auto`` stands for (:func:`resolve_scorer`): the drafter's question likelihood
  (``drafter``) where that reading costs at most a tenth of the target's prefill, else the
  question matched by meaning in the drafter's first two layers (``drafter-match``, a small
  share of a prefill whatever the drafter's depth): measured in docs/scorers.md. ``drafter`` and
  not ``hybrid`` (the same reading fused with BM25): on the recall sets ``drafter`` keeps at
  least ``hybrid``'s evidence in every cell, and on the LongBench sweep their scores tie
  (measured: docs/results.md, "Figures from the code's docstrings").
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from compression.drafter_scorers import AttentionScoring, DrafterAttentionScorer
from d3d.model.drafter import D3DDrafter
from d3d.model.load import DEFAULT_SPECS

# Measured on SmolLM2-135M (docs/longbench.md), on items built with other seeds than the
# evaluation sets: head 7 of the target's layer 7 ranks evidence best (layers 0-3 follow frequent
# words); the shipped 7-layer drafter's own heads, trained for drafting, rank it at chance. So
# the embedded default reads with the first 8 target layers: through the drafter itself when the
# drafter's layers are those frozen target layers (a gated-adapter drafter), else with a copy.
# Windows of 1,024 tokens make the reading linear in length, and much shorter than the target's
# prefill at 8k tokens (measured: docs/results.md, "Figures from the code's docstrings");
# 512-token windows read faster but double the query passes, which a second question pays
# (docs/longbench.md).
RETRIEVAL_HEADS = ((7, 7),)
RETRIEVAL_DEPTH = 8
SMOLLM2_ATTENTION = AttentionScoring(
    layers=RETRIEVAL_DEPTH,
    reader="target",
    heads=RETRIEVAL_HEADS,
    lookahead=False,
    quantize=True,
    window=1024,
)


def reads_like_target(drafter: D3DDrafter | None, depth: int = RETRIEVAL_DEPTH) -> bool:
    """Whether the drafter's first ``depth`` layers compute the target's (frozen, in order)."""
    if drafter is None or getattr(drafter, "adapters", None) is None:
        return False
    return tuple(drafter.meta.layers[:depth]) == tuple(range(depth))


def attention_preset(target_spec: str, drafter: D3DDrafter | None = None) -> AttentionScoring:
    """The attention-scorer settings for a target and its drafter (see the comment above);
    other targets read with the whole drafter, max over layers and heads."""
    if target_spec.lower() not in DEFAULT_SPECS:
        return AttentionScoring()
    if reads_like_target(drafter):
        return replace(SMOLLM2_ATTENTION, reader="drafter")
    return SMOLLM2_ATTENTION


def make_attention_scorer(
    att: AttentionScoring, drafter: D3DDrafter | None, target: PreTrainedModel | None = None
) -> DrafterAttentionScorer:
    """The attention scorer: the drafter reads, or the target's first layers when asked."""
    if drafter is None:
        raise ValueError("the attention scorer needs a drafter")
    if att.reader == "drafter":
        return DrafterAttentionScorer.from_drafter(drafter, att)
    if target is None:
        raise ValueError("the attention scorer's reader is the target, and none was given")
    return DrafterAttentionScorer(target, att, drafter.mask_embedding, drafter.block_size)


# ``auto`` reads with the drafter's question likelihood (``drafter``) where that reading costs at
# most this share of the target's prefill of the document, else with the drafter's first two
# layers (``drafter-match``): measured in docs/scorers.md.
AUTO_READING_SHARE = 0.10
QUESTION_OVERHEAD = 1.5  # tokens the question scorer runs per context token (the question copies)


def _layer_params(model: torch.nn.Module | None) -> int:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return sum(p.numel() for layer in layers for p in layer.parameters())


def reading_share(drafter: D3DDrafter, target: PreTrainedModel) -> float:
    """The question scorer's reading of a document over the target's prefill of it, from the
    weights each token meets (the drafter's layers, the question copies, the target's layers)."""
    own = _layer_params(target)
    return QUESTION_OVERHEAD * _layer_params(drafter.lm) / own if own else math.inf


def resolve_scorer(
    name: str, drafter: D3DDrafter | None, target: PreTrainedModel | None = None
) -> str:
    """The scorer ``name`` stands for: ``auto`` picks by the reading's cost (see above)."""
    if name != "auto":
        return name
    if drafter is None:
        return "bm25"
    if target is not None and reading_share(drafter, target) <= AUTO_READING_SHARE:
        return "drafter"
    return "drafter-match"
