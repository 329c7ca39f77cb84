"""The scorer interface and the model-free baselines.

A scorer maps a prompt's parts to one score per context token (higher = more worth keeping):
``score(parts) -> [N]`` with N = ``len(parts.context)``. Selection (:mod:`compression.selection`)
is shared by all scorers, so they differ only in what they rank. ``token_level`` scorers are
selected token by token instead of per chunk.

Baselines here:

- ``head-tail``: LongBench's truncation rule at the same budget (first half and last half of the
  kept tokens), as scores that fall with the distance to the nearer end of the context.
- ``random``: seeded uniform chunk scores.
- ``bm25``: Okapi BM25 of each chunk's words against the question's words, the chunks of the
  context being the corpus (k1 = 1.5, b = 0.75).

The drafter-based scorers live in :mod:`compression.drafter_scorers`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from compression.prompt import PromptParts, Tokenizer
from compression.selection import fixed_chunks

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
    """Ranks context tokens: ``score(parts)`` -> float tensor [N], N = len(parts.context)."""

    name: str
    token_level: bool

    def score(self, parts: PromptParts) -> torch.Tensor: ...


class HeadTailScorer:
    """Keeps the head and the tail of the context, as LongBench's middle truncation does."""

    name = "head-tail"
    token_level = True

    def score(self, parts: PromptParts) -> torch.Tensor:
        n = len(parts.context)
        i = torch.arange(n, dtype=torch.float32)
        # The head wins ties (i <= n-1-i), so an odd budget keeps one more head token.
        return -torch.minimum(i, (n - 1 - i) + 0.5)


class RandomScorer:
    """Seeded random chunk scores: every token of a chunk shares its chunk's draw."""

    name = "random"
    token_level = False

    def __init__(self, seed: int = 0, chunk_size: int = 32):
        self.seed = seed
        self.chunk_size = chunk_size

    def score(self, parts: PromptParts) -> torch.Tensor:
        n = len(parts.context)
        gen = torch.Generator().manual_seed(self.seed + n)
        chunks = fixed_chunks(n, self.chunk_size)
        draws = torch.rand(len(chunks), generator=gen)
        return torch.repeat_interleave(
            draws, torch.tensor([len(c) for c in chunks], dtype=torch.long)
        )


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


class BM25Scorer:
    """BM25 of fixed chunks of the context against the question (the suffix text)."""

    name = "bm25"
    token_level = False

    def __init__(self, tokenizer: Tokenizer, chunk_size: int = 32):
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size

    def score(self, parts: PromptParts) -> torch.Tensor:
        chunks = fixed_chunks(len(parts.context), self.chunk_size)
        docs = [words(self.tokenizer.decode(parts.context[c.start : c.end])) for c in chunks]
        query = words(self.tokenizer.decode(parts.suffix))
        scores = torch.tensor(bm25(query, docs), dtype=torch.float32)
        lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
        return torch.repeat_interleave(scores, lengths) if len(chunks) else torch.zeros(0)
