"""The scorer interface and the model-free baselines.

A scorer maps a prompt's parts to one score per context token (higher = more worth keeping):
``score(parts, units) -> [N]`` with N = ``len(parts.context)``. Selection (:mod:`compression.selection`)
is shared by all scorers, so they differ only in what they rank. ``token_level`` scorers are
selected token by token instead of per chunk.

Baselines here:

- ``head-tail``: LongBench's truncation rule at the same budget (first half and last half of the
  kept tokens), as scores that fall with the distance to the nearer end of the context.
- ``random``: seeded uniform unit scores.
- ``bm25``: Okapi BM25 of each unit's words against the question's words, the units of the
  context being the corpus (k1 = 1.5, b = 0.75).
- :class:`HybridScorer`: a drafter scorer and BM25 fused by weighted reciprocal rank fusion per
  unit (the drafter scorer is passed in: ``hybrid`` fuses the question likelihood of
  :mod:`compression.question_scorer`, ``attention-bm25`` the attention of
  :mod:`compression.drafter_scorers`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from compression.prompt import PromptParts, Tokenizer
from compression.selection import pool, spread
from compression.units import Chunk, fixed_chunks

WORD = re.compile(r"\w+", re.UNICODE)
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "to",
        "in",
        "on",
        "at",
        "for",
        "by",
        "with",
        "from",
        "and",
        "or",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "it",
        "its",
        "this",
        "that",
        "what",
        "which",
        "who",
        "whom",
        "whose",
        "when",
        "where",
        "why",
        "how",
        "do",
        "does",
        "did",
        "as",
        "into",
        "than",
        "then",
        "there",
        "their",
    ]
)


@runtime_checkable
class Scorer(Protocol):
    """Ranks context tokens: ``score(parts, units)`` -> float tensor [N], N = len(parts.context).

    ``units`` is the compressor's segmentation of the context; scorers that rank units (BM25,
    random, hybrid) score those, token scorers (attention, head-tail) may ignore it.
    """

    name: str
    token_level: bool

    def score(self, parts: PromptParts, units: Sequence[Chunk]) -> torch.Tensor: ...


def has_read(scorer: Scorer, parts: PromptParts, units: Sequence[Chunk]) -> bool:
    """Whether a scorer that reads documents (one with ``has_read``) has read this one already,
    so its next question costs no document pass; False for scorers that keep nothing."""
    check = getattr(scorer, "has_read", None)
    return bool(check is not None and check(parts, units))


class HeadTailScorer:
    """Keeps the head and the tail of the context, as LongBench's middle truncation does."""

    name = "head-tail"
    token_level = True

    def score(self, parts: PromptParts, units: Sequence[Chunk] = ()) -> torch.Tensor:
        n = len(parts.context)
        i = torch.arange(n, dtype=torch.float32)
        # The head wins ties (i <= n-1-i), so an odd budget keeps one more head token.
        return -torch.minimum(i, (n - 1 - i) + 0.5)


class RandomScorer:
    """Seeded random unit scores: every token of a unit shares its unit's draw."""

    name = "random"
    token_level = False

    def __init__(self, seed: int = 0, chunk_size: int = 32):
        self.seed = seed
        self.chunk_size = chunk_size

    def score(self, parts: PromptParts, units: Sequence[Chunk] | None = None) -> torch.Tensor:
        n = len(parts.context)
        units = units if units is not None else fixed_chunks(n, self.chunk_size)
        gen = torch.Generator().manual_seed(self.seed + n)
        return spread(torch.rand(len(units), generator=gen), units)


def words(text: str) -> list[str]:
    """Lower-cased word tokens without stop words."""
    return [w for w in WORD.findall(text.lower()) if w not in STOPWORDS]


def bm25(
    query: Sequence[str], docs: Sequence[Sequence[str]], k1: float = 1.5, b: float = 0.75
) -> list[float]:
    """Okapi BM25 of each document (a list of words) against the query words: -> list[float]."""
    n = len(docs)
    if n == 0:
        return []
    avg = sum(len(d) for d in docs) / n or 1.0
    df = Counter(w for d in docs for w in set(d))
    out = []
    for d in docs:
        tf = Counter(d)
        s = 0.0
        for w in set(query):
            if tf[w] == 0:
                continue
            idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
            s += idf * tf[w] * (k1 + 1) / (tf[w] + k1 * (1 - b + b * len(d) / avg))
        out.append(s)
    return out


def unit_texts(tokenizer: Tokenizer, parts: PromptParts, units: Sequence[Chunk]) -> list[str]:
    """The text of each unit (one batched decode)."""
    ids = [list(parts.context[c.start : c.end]) for c in units]
    batch = getattr(tokenizer, "batch_decode", None)
    return list(batch(ids)) if batch else [tokenizer.decode(i) for i in ids]


class BM25Scorer:
    """BM25 of each unit of the context against the question (the suffix text)."""

    name = "bm25"
    token_level = False

    def __init__(self, tokenizer: Tokenizer, chunk_size: int = 32):
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size

    def unit_scores(self, parts: PromptParts, units: Sequence[Chunk]) -> torch.Tensor:
        """BM25 per unit: [C]."""
        docs = [words(t) for t in unit_texts(self.tokenizer, parts, units)]
        query = words(self.tokenizer.decode(parts.suffix))
        return torch.tensor(bm25(query, docs), dtype=torch.float32)

    def score(self, parts: PromptParts, units: Sequence[Chunk] | None = None) -> torch.Tensor:
        units = units if units is not None else fixed_chunks(len(parts.context), self.chunk_size)
        return spread(self.unit_scores(parts, units), units)


def contrast(matches: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-unit scores [C] from per-unit, per-question-token evidence ``matches`` [C, Q]: each
    token counts in a unit by how much its evidence there rises above its median over the units,
    ``sum_t w_t max(0, m[u, t] - median_v m[v, t])``. A question token every unit supports alike
    (a function word, the document's topic) adds nothing; a unit is ranked by what it supports
    better than a typical unit does. ``weights`` [Q]: one per token (None: 1)."""
    typical = matches.median(dim=0, keepdim=True).values  # [1, Q]
    rise = (matches - typical).clamp(min=0)
    return (rise if weights is None else rise * weights[None, :]).sum(dim=1)


FUSIONS = ("sum", "max")


def rank_fusion(
    scores: Sequence[torch.Tensor],
    weights: Sequence[float],
    k: float = 20.0,
    how: str = "sum",
    gated: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Weighted reciprocal rank fusion of unit scores [C] each -> [C].

    ``sum``: a unit's fused score is sum_s w_s / (k + rank_s), rank 1 = best (a unit both rank
    fairly high beats one that only one of them ranks first). ``max``: max_s w_s / (k + rank_s),
    the sum breaking ties: the components' best units interleave, so a unit only one component
    finds (a paraphrased fact, which BM25 cannot see) is kept as surely as its best. A unit
    scoring <= 0 under a *gated* component, one that scores evidence positively (BM25: no
    question word), gets nothing from it, so ties among non-matching units do not hand out rank
    credit; ``gated`` says which components are (None: all). Ties share the better rank.
    """
    if how not in FUSIONS:
        raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, got {how!r}")
    c = scores[0].numel()
    fused, best = torch.zeros(c), torch.zeros(c)
    gates = [True] * len(scores) if gated is None else list(gated)
    for s, w, gate in zip(scores, weights, gates, strict=True):
        s = s.float()
        order = torch.argsort(-s, stable=True)
        rank = torch.empty(c)
        rank[order] = torch.arange(1, c + 1, dtype=torch.float32)
        for v in s.unique():  # equal scores share the best rank among them
            tie = s == v
            rank[tie] = rank[tie].min()
        credit = w / (k + rank) * ((s > 0).float() if gate else 1.0)
        fused += credit
        best = torch.maximum(best, credit)
    return fused if how == "sum" else best + 1e-3 * fused


class HybridScorer:
    """A drafter scorer fused with BM25 by weighted reciprocal rank fusion, per unit.

    The drafter scorer's token scores are pooled per unit (``pooling``) and ranked; BM25 ranks
    the units that share words with the question. Only BM25's ranking is gated (a unit with no
    question word gets nothing from it); the drafter's ranks every unit, whatever the sign of
    its scores (attention weights, log-likelihoods).
    """

    name = "hybrid"
    token_level = False

    def __init__(
        self,
        attention: Scorer,
        lexical: BM25Scorer,
        weights: tuple[float, float] = (1.0, 1.0),
        k: float = 20.0,
        pooling: str = "mean",
        name: str = "hybrid",
        fusion: str = "sum",
    ):
        self.name = name
        self.fusion = fusion
        self.attention = attention
        self.lexical = lexical
        self.weights = weights
        self.k = k
        self.pooling = pooling

    def has_read(self, parts: PromptParts, units: Sequence[Chunk]) -> bool:
        """Whether its drafter scorer's reading of the document is kept (BM25 reads nothing)."""
        return has_read(self.attention, parts, units)

    def score(self, parts: PromptParts, units: Sequence[Chunk] | None = None) -> torch.Tensor:
        units = units if units is not None else fixed_chunks(len(parts.context), 32)
        att = pool(self.attention.score(parts, units), units, self.pooling)
        lex = self.lexical.unit_scores(parts, units)
        fused = rank_fusion([att, lex], self.weights, self.k, self.fusion, gated=(False, True))
        return spread(fused, units)
