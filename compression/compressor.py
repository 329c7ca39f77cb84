"""Compression of a prompt's context to a keep ratio: config, scorer registry, result.

``Compressor.score`` runs the scorer once per prompt (the expensive part, timed);
``Compressor.select`` turns the scores into a compressed prompt at any keep ratio, so a sweep over
keep ratios scores each prompt once and charges the scoring time to every ratio.
``Compressor.compress`` does both. Keep ratio 1.0 skips the scorer and returns the prompt as is.

The instruction (prefix) and the question (suffix) are always kept whole; the budget applies to
context tokens: ``round(keep_ratio * len(context))``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import PreTrainedModel

from compression.drafter_scorers import (
    AttentionScoring,
    DrafterAttentionScorer,
    DrafterPerplexityScorer,
)
from compression.prompt import PromptParts, Tokenizer
from compression.scorers import BM25Scorer, HeadTailScorer, RandomScorer, Scorer
from compression.selection import budget, fixed_chunks, pool, select, sentence_chunks
from d3d.drafter import D3DDrafter
from d3d.models import DEFAULT_SPECS

SCORERS = ("drafter-attention", "head-tail", "random", "bm25", "drafter-ppl")
DRAFTER_SCORERS = ("drafter-attention", "drafter-ppl")


@dataclass(frozen=True)
class CompressionConfig:
    """How to score and select (scorer-specific settings are ignored by the other scorers)."""

    scorer: str = "drafter-attention"
    keep_ratio: float = 0.1
    chunk_size: int = 32
    granularity: str = "chunk"
    pooling: str = "mean"
    seed: int = 0
    attention: AttentionScoring = field(default_factory=AttentionScoring)
    ppl_layers: int | None = None

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.scorer!r}: choose from {', '.join(SCORERS)}")
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ValueError(f"keep ratio must be in (0, 1], got {self.keep_ratio}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {self.chunk_size}")
        if self.granularity not in ("chunk", "sentence"):
            raise ValueError(f"granularity must be chunk or sentence, got {self.granularity!r}")
        if self.pooling not in ("mean", "max"):
            raise ValueError(f"pooling must be mean or max, got {self.pooling!r}")


@dataclass(frozen=True)
class ContextScores:
    """One prompt's token scores [N] and the seconds the scorer took."""

    scores: torch.Tensor
    seconds: float


@dataclass(frozen=True)
class Compressed:
    """A compressed prompt and what compression did."""

    parts: PromptParts
    kept: tuple[int, ...]
    total_tokens: int
    scorer: str
    keep_ratio: float
    seconds: float

    @property
    def kept_tokens(self) -> int:
        return len(self.parts)

    @property
    def context_tokens(self) -> int:
        return self.total_tokens - len(self.parts.prefix) - len(self.parts.suffix)

    def to_dict(self) -> dict:
        return {
            "total_tokens": self.total_tokens,
            "kept_tokens": self.kept_tokens,
            "context_tokens": self.context_tokens,
            "kept_context_tokens": len(self.kept),
            "keep_ratio": self.keep_ratio,
            "scorer": self.scorer,
            "seconds": round(self.seconds, 4),
        }


# Measured on SmolLM2-135M (the embedded default; see docs/longbench.md): layers 0-3 do not
# find the needle (their attention follows frequent words), head 7 of layer 7 does; int8 layers
# halve the reading time at a small loss. Calibrated on items built with other seeds than the
# evaluation sets.
SMOLLM2_ATTENTION = AttentionScoring(
    layers=8, reader="target", heads=((7, 7),), lookahead=False, quantize=True
)


def attention_preset(target_spec: str) -> AttentionScoring:
    """The attention-scorer settings for a target: the measured preset for the embedded default,
    else the generic drafter-layer reading."""
    return SMOLLM2_ATTENTION if target_spec.lower() in DEFAULT_SPECS else AttentionScoring()


def make_scorer(
    cfg: CompressionConfig,
    tokenizer: Tokenizer | None = None,
    drafter: D3DDrafter | None = None,
    target: PreTrainedModel | None = None,
) -> Scorer:
    """Build the scorer ``cfg.scorer`` names (drafter scorers need ``drafter``; the attention
    scorer reads with the target's first layers instead when ``cfg.attention.reader`` says so)."""
    if cfg.scorer in DRAFTER_SCORERS and drafter is None:
        raise ValueError(f"scorer {cfg.scorer!r} needs a drafter")
    if cfg.scorer == "drafter-attention":
        att = cfg.attention
        source = target if att.reader == "target" else drafter.lm  # type: ignore[union-attr]
        if source is None:
            raise ValueError("the attention scorer's reader is the target, and none was given")
        return DrafterAttentionScorer(
            source,
            att,
            drafter.mask_embedding,
            drafter.block_size,  # type: ignore[union-attr]
        )
    if cfg.scorer == "drafter-ppl":
        return DrafterPerplexityScorer(drafter.lm, cfg.ppl_layers)  # type: ignore[union-attr]
    if cfg.scorer == "head-tail":
        return HeadTailScorer()
    if cfg.scorer == "random":
        return RandomScorer(cfg.seed, cfg.chunk_size)
    if tokenizer is None:
        raise ValueError("scorer 'bm25' needs a tokenizer")
    return BM25Scorer(tokenizer, cfg.chunk_size)


class Compressor:
    """Scores a prompt's context with one scorer and keeps the best part of it."""

    def __init__(self, scorer: Scorer, cfg: CompressionConfig, tokenizer: Tokenizer | None = None):
        if cfg.granularity == "sentence" and tokenizer is None:
            raise ValueError("sentence granularity needs a tokenizer")
        self.scorer = scorer
        self.cfg = cfg
        self.tokenizer = tokenizer

    @classmethod
    def build(
        cls,
        cfg: CompressionConfig,
        tokenizer: Tokenizer | None = None,
        drafter: D3DDrafter | None = None,
        target: PreTrainedModel | None = None,
    ) -> Compressor:
        return cls(make_scorer(cfg, tokenizer, drafter, target), cfg, tokenizer)

    def score(self, parts: PromptParts) -> ContextScores:
        t0 = time.perf_counter()
        scores = self.scorer.score(parts)
        if scores.shape != (len(parts.context),):
            raise RuntimeError(
                f"scorer {self.scorer.name} returned shape {tuple(scores.shape)} "
                f"for {len(parts.context)} context tokens"
            )
        return ContextScores(scores.float().cpu(), time.perf_counter() - t0)

    def _chunks(self, parts: PromptParts):
        n = len(parts.context)
        if self.scorer.token_level:
            return fixed_chunks(n, 1)
        if self.cfg.granularity == "sentence":
            texts = [self.tokenizer.decode([t]) for t in parts.context]  # type: ignore[union-attr]
            return sentence_chunks(texts, max_len=2 * self.cfg.chunk_size)
        return fixed_chunks(n, self.cfg.chunk_size)

    def select(
        self, parts: PromptParts, scored: ContextScores, keep_ratio: float | None = None
    ) -> Compressed:
        ratio = self.cfg.keep_ratio if keep_ratio is None else keep_ratio
        t0 = time.perf_counter()
        n = len(parts.context)
        n_keep = budget(n, ratio)
        if n_keep >= n:
            kept = list(range(n))
        else:
            chunks = self._chunks(parts)
            kept = select(pool(scored.scores, chunks, self.cfg.pooling), chunks, n_keep)
        out = parts.with_context([parts.context[i] for i in kept])
        seconds = scored.seconds + time.perf_counter() - t0
        return Compressed(out, tuple(kept), len(parts), self.scorer.name, ratio, seconds)

    def compress(self, parts: PromptParts, keep_ratio: float | None = None) -> Compressed:
        ratio = self.cfg.keep_ratio if keep_ratio is None else keep_ratio
        if budget(len(parts.context), ratio) >= len(parts.context):
            n = len(parts.context)
            return Compressed(parts, tuple(range(n)), len(parts), self.scorer.name, ratio, 0.0)
        return self.select(parts, self.score(parts), ratio)


def config_dict(cfg: CompressionConfig) -> dict:
    """A JSON-friendly view of a config (for results files)."""
    return asdict(cfg)
