"""Chunking the context and keeping the best chunks up to a token budget.

Pure functions over token scores. A scorer gives every context token a score (higher = keep);
:func:`pool` turns those into one score per chunk; :func:`select` keeps the best chunks until the
budget is spent and returns the kept token indices in original order. The budget is exact: the
last chunk that does not fit whole is cut to the tokens that do (its head), so every scorer is
compared at the same number of kept tokens.

Chunks are fixed windows of ``chunk_size`` tokens (SpecPrefill uses 32) or sentences: runs of
tokens that end at a token whose text ends a sentence or a line, split further when longer than
``max_len``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SENTENCE_END = (".", "!", "?", "\n", "。", "！", "？")


@dataclass(frozen=True)
class Chunk:
    """Context tokens ``[start, end)``."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def budget(n: int, keep_ratio: float) -> int:
    """Tokens kept out of ``n`` at ``keep_ratio`` in (0, 1] (at least one when n > 0)."""
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep ratio must be in (0, 1], got {keep_ratio}")
    return min(n, max(1 if n else 0, round(keep_ratio * n)))


def fixed_chunks(n: int, size: int) -> list[Chunk]:
    """Consecutive windows of ``size`` tokens covering ``[0, n)`` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [Chunk(s, min(s + size, n)) for s in range(0, n, size)]


def sentence_chunks(token_texts: Sequence[str], max_len: int = 64) -> list[Chunk]:
    """Sentences from per-token texts, each at most ``max_len`` tokens."""
    out: list[Chunk] = []
    start = 0
    for i, text in enumerate(token_texts):
        if text.rstrip(" ").endswith(SENTENCE_END) or i + 1 - start >= max_len:
            out.append(Chunk(start, i + 1))
            start = i + 1
    if start < len(token_texts):
        out.append(Chunk(start, len(token_texts)))
    return out


def smooth(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Moving average over ``kernel`` tokens (odd; 1 = no smoothing): [N] -> [N]."""
    if kernel <= 1 or scores.numel() == 0:
        return scores
    x = scores.float().view(1, 1, -1)
    pad = kernel // 2
    x = torch.nn.functional.pad(x, (pad, pad), mode="replicate")
    return torch.nn.functional.avg_pool1d(x, kernel, stride=1).view(-1)[: scores.numel()]


def pool(scores: torch.Tensor, chunks: Sequence[Chunk], how: str = "mean") -> torch.Tensor:
    """One score per chunk from token scores [N] -> [C] (``mean`` or ``max``)."""
    if how not in ("mean", "max"):
        raise ValueError(f"pooling must be mean or max, got {how!r}")
    out = torch.empty(len(chunks))
    for j, c in enumerate(chunks):
        seg = scores[c.start : c.end].float()
        out[j] = seg.mean() if how == "mean" else seg.max()
    return out


def select(chunk_scores: torch.Tensor, chunks: Sequence[Chunk], n_keep: int) -> list[int]:
    """Indices of kept context tokens, ascending: best chunks first, exactly ``n_keep`` tokens.

    Ties go to the earlier chunk. NaN scores rank last.
    """
    if len(chunk_scores) != len(chunks):
        raise ValueError("one score per chunk expected")
    s = [(-math.inf if math.isnan(v) else v) for v in chunk_scores.tolist()]
    order = sorted(range(len(chunks)), key=lambda j: (-s[j], j))
    kept: list[int] = []
    left = n_keep
    for j in order:
        if left <= 0:
            break
        c = chunks[j]
        take = min(len(c), left)
        kept.extend(range(c.start, c.start + take))
        left -= take
    return sorted(kept)
