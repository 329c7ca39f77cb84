"""Compression of a prompt's context to a keep ratio: config, scorer registry, result.

``Compressor.score`` runs the scorer once per prompt (the expensive part, timed);
``Compressor.select`` turns the scores into a compressed prompt at any keep ratio, so a sweep over
keep ratios scores each prompt once and charges the scoring time to every ratio.
``Compressor.compress`` does both. Keep ratio 1.0 skips the scorer and returns the prompt as is.

The instruction (prefix) and the question (suffix) are always kept whole; the budget applies to
context tokens: ``round(keep_ratio * len(context))``. The kept context the target reads is the
kept runs in document order with a marker at each cut (:mod:`compression.gaps`):
``Compressed.parts`` is that prompt, ``Compressed.kept`` the kept indices into the original
context and ``Compressed.spans`` its kept runs.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
from transformers import PreTrainedModel

from compression.drafter_scorers import (
    AttentionScoring,
    DrafterAttentionScorer,
    DrafterPerplexityScorer,
)
from compression.gaps import GAPS, GapMarker, runs
from compression.match_scorer import DrafterMatchScorer
from compression.presets import make_attention_scorer, resolve_scorer
from compression.prompt import PromptParts, Tokenizer
from compression.question_scorer import DrafterQuestionScorer
from compression.scorers import (
    FUSIONS,
    BM25Scorer,
    HeadTailScorer,
    HybridScorer,
    RandomScorer,
    Scorer,
    has_read,
)
from compression.selection import (
    DEFAULT_KEEP_RATIO,
    budget,
    check_keep_ratio,
    head_units,
    pool,
    select,
)
from compression.units import GRANULARITIES, Chunk, fixed_chunks, max_unit, segment
from d3d.model.drafter import D3DDrafter

SCORERS = (
    "auto",
    "attention-bm25",
    "hybrid",
    "drafter",
    "drafter-match",
    "drafter-attention",
    "bm25",
    "head-tail",
    "random",
    "drafter-ppl",
)
DRAFTER_SCORERS = (
    "auto",
    "attention-bm25",
    "hybrid",
    "drafter",
    "drafter-match",
    "drafter-attention",
    "drafter-ppl",
)
ATTENTION_SCORERS = ("attention-bm25", "drafter-attention")  # read with the attention reader
QUESTION_SCORERS = ("hybrid", "drafter")  # read with the question-likelihood reader
DEFAULT_SCORER = "auto"


@dataclass(frozen=True)
class CompressionConfig:
    """How to score and select (scorer-specific settings are ignored by the other scorers)."""

    scorer: str = DEFAULT_SCORER
    keep_ratio: float = DEFAULT_KEEP_RATIO
    chunk_size: int = 32
    granularity: str = "packed"
    neighbours: int = 0
    pooling: str = "mean"
    seed: int = 0
    attention: AttentionScoring | None = None  # None: the preset for the target and drafter
    fusion_weights: tuple[float, float] = (0.5, 1.0)  # attention-bm25: attention, bm25
    question_fusion: tuple[float, float] = (1.0, 1.0)  # hybrid: drafter, bm25
    hybrid_fusion: str = "max"  # hybrid: how the two rankings combine (scorers.rank_fusion)
    question_int8: bool = False  # drafter, hybrid: an int8 copy of the drafter reads
    fusion_k: float = 20.0
    ppl_layers: int | None = None
    head: float = 0.35  # share of the budget for the document head (calibrated: docs/longbench.md)
    gap: str = "ellipsis"  # what marks a cut in the kept context (compression.gaps.GAPS)

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.scorer!r}: choose from {', '.join(SCORERS)}")
        check_keep_ratio(self.keep_ratio)
        if self.chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {self.chunk_size}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}"
            )
        if self.neighbours < 0:
            raise ValueError(f"neighbours must be >= 0, got {self.neighbours}")
        if len(self.fusion_weights) != 2 or min(self.fusion_weights) < 0:
            raise ValueError(f"fusion weights must be two numbers >= 0, got {self.fusion_weights}")
        if not 0.0 <= self.head < 1.0:
            raise ValueError(f"head share must be in [0, 1), got {self.head}")
        if self.hybrid_fusion not in FUSIONS:
            raise ValueError(f"hybrid fusion must be one of {FUSIONS}, got {self.hybrid_fusion!r}")
        if self.pooling not in ("mean", "max"):
            raise ValueError(f"pooling must be mean or max, got {self.pooling!r}")
        if self.gap not in GAPS:
            raise ValueError(f"gap must be one of {', '.join(GAPS)}, got {self.gap!r}")


@dataclass(frozen=True)
class ContextScores:
    """One prompt's token scores [N], the units they were scored with, and the seconds taken."""

    scores: torch.Tensor
    seconds: float
    units: tuple[Chunk, ...] = ()


@dataclass(frozen=True)
class Compressed:
    """A compressed prompt and what compression did.

    ``parts``: the prompt the target reads (kept runs joined by gap markers); ``kept``: the kept
    indices into the original context."""

    parts: PromptParts
    kept: tuple[int, ...]
    total_tokens: int
    scorer: str
    keep_ratio: float
    seconds: float
    # Kept context tokens from the document's start that every question keeps (all of them
    # when nothing is cut: a second question about the document reads only its own suffix).
    head: int = 0

    @property
    def shared_prefix(self) -> int:
        """Prompt tokens (instruction and document head) the same for every question."""
        return len(self.parts.prefix) + self.head

    @property
    def kept_tokens(self) -> int:
        return len(self.parts)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The kept runs ``[start, end)`` of the original context, in order."""
        return tuple(runs(self.kept))

    @property
    def context_tokens(self) -> int:
        return self.total_tokens - len(self.parts.prefix) - len(self.parts.suffix)

    def to_dict(self) -> dict:
        return {
            "total_tokens": self.total_tokens,
            "kept_tokens": self.kept_tokens,
            "context_tokens": self.context_tokens,
            "kept_context_tokens": len(self.kept),
            "marker_tokens": len(self.parts.context) - len(self.kept),
            "keep_ratio": self.keep_ratio,
            "scorer": self.scorer,
            "seconds": round(self.seconds, 4),
            "head_tokens": self.head,
        }


def make_scorer(
    cfg: CompressionConfig,
    tokenizer: Tokenizer | None = None,
    drafter: D3DDrafter | None = None,
    target: PreTrainedModel | None = None,
    attention: DrafterAttentionScorer | None = None,
    question: DrafterQuestionScorer | None = None,
) -> Scorer:
    """Build the scorer ``cfg.scorer`` names (drafter scorers need ``drafter``; ``attention``,
    ``question``: readers already built, shared instead of building another)."""
    cfg = replace(cfg, scorer=resolve_scorer(cfg.scorer, drafter, target))
    if cfg.scorer in DRAFTER_SCORERS and drafter is None and attention is None and question is None:
        raise ValueError(f"scorer {cfg.scorer!r} needs a drafter")
    if cfg.scorer in ("hybrid", "attention-bm25", "bm25") and tokenizer is None:
        raise ValueError(f"scorer {cfg.scorer!r} needs a tokenizer")
    reader: Scorer | None = None
    if cfg.scorer in ATTENTION_SCORERS:
        reader = attention or make_attention_scorer(
            cfg.attention or AttentionScoring(), drafter, target
        )
    elif cfg.scorer in QUESTION_SCORERS:
        if question is None and tokenizer is None:
            raise ValueError(f"scorer {cfg.scorer!r} needs a tokenizer")
        reader = question or DrafterQuestionScorer(
            drafter,  # type: ignore[arg-type]
            tokenizer,  # type: ignore[arg-type]
            quantize=cfg.question_int8,
        )
    if cfg.scorer in ("drafter", "drafter-attention"):
        return reader  # type: ignore[return-value]
    if reader is not None:  # the hybrids: the drafter's reading fused with BM25
        lexical = BM25Scorer(tokenizer, cfg.chunk_size)  # type: ignore[arg-type]
        weights = cfg.fusion_weights if cfg.scorer == "attention-bm25" else cfg.question_fusion
        fusion = "sum" if cfg.scorer == "attention-bm25" else cfg.hybrid_fusion
        return HybridScorer(reader, lexical, weights, cfg.fusion_k, cfg.pooling, cfg.scorer, fusion)
    if cfg.scorer == "drafter-match":
        return DrafterMatchScorer(drafter)  # type: ignore[arg-type]
    if cfg.scorer == "drafter-ppl":
        return DrafterPerplexityScorer(drafter)  # type: ignore[arg-type]
    if cfg.scorer == "head-tail":
        return HeadTailScorer()
    if cfg.scorer == "random":
        return RandomScorer(cfg.seed, cfg.chunk_size)
    return BM25Scorer(tokenizer, cfg.chunk_size)  # type: ignore[arg-type]


def token_texts(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """The text of each token alone (one batched decode)."""
    batch = getattr(tokenizer, "batch_decode", None)
    singles = [[int(t)] for t in ids]
    return list(batch(singles)) if batch else [tokenizer.decode(t) for t in singles]


class Compressor:
    """Segments a prompt's context, scores it with one scorer and keeps the best units."""

    def __init__(self, scorer: Scorer, cfg: CompressionConfig, tokenizer: Tokenizer | None = None):
        if cfg.granularity != "chunk" and tokenizer is None:
            raise ValueError(f"{cfg.granularity} granularity needs a tokenizer")
        self.scorer = scorer
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.gap = GapMarker(cfg.gap, tokenizer)
        # A document's units do not depend on the question: the next question about it (and
        # the sweep's other keep ratios) skip decoding every token again (~30 ms at 4k).
        self._segment = functools.lru_cache(maxsize=8)(self._segment_uncached)

    @classmethod
    def build(
        cls,
        cfg: CompressionConfig,
        tokenizer: Tokenizer | None = None,
        drafter: D3DDrafter | None = None,
        target: PreTrainedModel | None = None,
        attention: DrafterAttentionScorer | None = None,
        question: DrafterQuestionScorer | None = None,
    ) -> Compressor:
        scorer = make_scorer(cfg, tokenizer, drafter, target, attention, question)
        return cls(scorer, cfg, tokenizer)

    def units(self, parts: PromptParts) -> list[Chunk]:
        """The context's units at the configured granularity."""
        if self.cfg.granularity == "chunk":
            return fixed_chunks(len(parts.context), self.cfg.chunk_size)
        return list(self._segment(tuple(parts.context)))

    def _segment_uncached(self, context: tuple[int, ...]) -> tuple[Chunk, ...]:
        texts = token_texts(self.tokenizer, context)  # type: ignore[arg-type]
        return tuple(segment(texts, self.cfg.granularity, self.cfg.chunk_size))

    def head_tokens(self, units: Sequence[Chunk], keep_ratio: float | None = None) -> int:
        """Context tokens of the document's head that selection will keep (question-free)."""
        n = units[-1].end if units else 0
        n_keep = budget(n, self.cfg.keep_ratio if keep_ratio is None else keep_ratio)
        if n_keep >= n or self.scorer.token_level or not self.cfg.head:
            return 0
        m = head_units(units, round(self.cfg.head * n_keep))
        return units[m - 1].end if m else 0

    def has_read(self, parts: PromptParts) -> bool:
        """Whether the scorer's pass over this document is kept (see :func:`scorers.has_read`)."""
        return has_read(self.scorer, parts, self.units(parts))

    def score(self, parts: PromptParts, units: Sequence[Chunk] | None = None) -> ContextScores:
        """Segment (unless ``units`` are given) and score (the timed, question-dependent work)."""
        t0 = time.perf_counter()
        units = list(units) if units is not None else self.units(parts)
        scores = self.scorer.score(parts, units)
        if scores.shape != (len(parts.context),):
            raise RuntimeError(
                f"scorer {self.scorer.name} returned shape {tuple(scores.shape)} "
                f"for {len(parts.context)} context tokens"
            )
        return ContextScores(scores.float().cpu(), time.perf_counter() - t0, tuple(units))

    def select(
        self, parts: PromptParts, scored: ContextScores, keep_ratio: float | None = None
    ) -> Compressed:
        ratio = self.cfg.keep_ratio if keep_ratio is None else keep_ratio
        t0 = time.perf_counter()
        n = len(parts.context)
        n_keep = budget(n, ratio)
        head = 0
        if n_keep >= n:  # nothing cut: the whole document is the same for every question
            kept, head = list(range(n)), n
        elif self.scorer.token_level:
            kept = select(scored.scores, fixed_chunks(n, 1), n_keep)
        else:
            units = list(scored.units)
            pooled = pool(scored.scores, units, self.cfg.pooling)
            m = head_units(units, round(self.cfg.head * n_keep))
            pooled[:m] = math.inf  # the document's head: kept first, whatever the question
            head = self.head_tokens(units, ratio)
            kept = select(
                pooled,
                units,
                n_keep,
                self.cfg.neighbours,
                cut_last=self.cfg.granularity == "chunk",
                finish=max_unit(self.cfg.granularity, self.cfg.chunk_size),
            )
        out = parts.with_context(self.gap.join(parts, kept))
        seconds = scored.seconds + time.perf_counter() - t0
        return Compressed(out, tuple(kept), len(parts), self.scorer.name, ratio, seconds, head)

    def compress(
        self,
        parts: PromptParts,
        keep_ratio: float | None = None,
        on_head: Callable[[int], None] | None = None,
    ) -> Compressed:
        """Score and select. ``on_head``: called with the head's context tokens once the units
        are known, before scoring (the caller can start the target on the head meanwhile)."""
        ratio = self.cfg.keep_ratio if keep_ratio is None else keep_ratio
        if budget(len(parts.context), ratio) >= len(parts.context):  # nothing cut, see select
            n = len(parts.context)
            return Compressed(parts, tuple(range(n)), len(parts), self.scorer.name, ratio, 0.0, n)
        t0 = time.perf_counter()
        units = self.units(parts)
        if on_head is not None and (head := self.head_tokens(units, ratio)):
            on_head(head)
        segmenting = time.perf_counter() - t0
        scored = self.score(parts, units)
        scored = ContextScores(scored.scores, scored.seconds + segmenting, scored.units)
        return self.select(parts, scored, ratio)


def config_dict(cfg: CompressionConfig) -> dict:
    """A JSON-friendly view of a config (for results files)."""
    return asdict(cfg)
