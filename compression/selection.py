"""Segmenting the context into units, and keeping the best units up to a token budget.

Pure functions over token texts and scores. A scorer gives every context token a score (higher =
keep); :func:`pool` turns those into one score per unit; :func:`select` keeps the best units
until the budget is spent and returns the kept token indices in original order.

Segmentation (``granularity``):

- ``chunk``: fixed windows of ``chunk_size`` tokens (SpecPrefill's 32). Cheap, but a sentence
  that straddles a boundary is split, and its halves are scored (and kept) apart.
- ``sentence``: one unit per sentence (or line: code and tables end their units at newlines),
  sentences longer than ``2 x chunk_size`` split into pieces.
- ``packed`` (the default): consecutive sentences packed into units of at most ``chunk_size``
  tokens; a sentence is only cut when it alone exceeds the chunk size. Units are about as even as
  fixed chunks, and a kept unit is whole sentences.

A sentence ends at a token whose text (closing quotes and brackets aside) ends in ``. ! ?`` and
is followed by whitespace, or at a token holding a newline; so ``3.5`` or ``e.g.x`` do not end
one.

Selection keeps units best first and never cuts one: a unit that no longer fits is skipped and
the next best that fits is taken, so the kept count is the budget or a little under it (less
than one unit). ``neighbours=w`` extends each chosen unit by up to ``w`` units on each side while
the budget allows, before the next-ranked unit is considered: an answer sentence then comes
with its surroundings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SENTENCE_END = (".", "!", "?", "。", "！", "？")
CLOSERS = "\"')]}”’»"
GRANULARITIES = ("chunk", "sentence", "packed")


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


def _ends_sentence(text: str, next_text: str | None) -> bool:
    if "\n" in text:
        return True
    core = text.rstrip().rstrip(CLOSERS)
    if not core.endswith(SENTENCE_END):
        return False
    # "3.5", "U.S.A": the next token carries on the word; a sentence needs a space after it.
    return next_text is None or next_text[:1].isspace() or text != text.rstrip()


def _split(c: Chunk, max_len: int) -> list[Chunk]:
    return [Chunk(s, min(s + max_len, c.end)) for s in range(c.start, c.end, max_len)]


def sentence_chunks(token_texts: Sequence[str], max_len: int = 64) -> list[Chunk]:
    """Sentences (or lines) from per-token texts, each at most ``max_len`` tokens."""
    out: list[Chunk] = []
    start, n = 0, len(token_texts)
    for i, text in enumerate(token_texts):
        nxt = token_texts[i + 1] if i + 1 < n else None
        if _ends_sentence(text, nxt):
            out.extend(_split(Chunk(start, i + 1), max_len))
            start = i + 1
    if start < n:
        out.extend(_split(Chunk(start, n), max_len))
    return out


def packed_chunks(token_texts: Sequence[str], size: int = 32) -> list[Chunk]:
    """Whole sentences packed into units of at most ``size`` tokens (long ones cut to size)."""
    out: list[Chunk] = []
    cur: Chunk | None = None
    for s in sentence_chunks(token_texts, max_len=size):
        if cur is not None and len(cur) + len(s) <= size:
            cur = Chunk(cur.start, s.end)
            continue
        if cur is not None:
            out.append(cur)
        cur = s
    if cur is not None:
        out.append(cur)
    return out


def segment(token_texts: Sequence[str], granularity: str, size: int) -> list[Chunk]:
    """Units of the context at ``granularity`` (see the module docstring)."""
    if granularity == "chunk":
        return fixed_chunks(len(token_texts), size)
    if granularity == "sentence":
        return sentence_chunks(token_texts, max_len=2 * size)
    if granularity == "packed":
        return packed_chunks(token_texts, size)
    raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")


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


def spread(unit_scores: Sequence[float] | torch.Tensor, chunks: Sequence[Chunk]) -> torch.Tensor:
    """Unit scores [C] -> token scores [N] (every token gets its unit's score)."""
    if not chunks:
        return torch.zeros(0)
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
    return torch.repeat_interleave(torch.as_tensor(unit_scores, dtype=torch.float32), lengths)


def head_units(units: Sequence[Chunk], n_tokens: int) -> int:
    """How many leading units fit in ``n_tokens`` (the document's head, kept for any question)."""
    used = 0
    for j, u in enumerate(units):
        used += len(u)
        if used > n_tokens:
            return j
    return len(units)


def select(
    chunk_scores: torch.Tensor,
    chunks: Sequence[Chunk],
    n_keep: int,
    neighbours: int = 0,
    cut_last: bool = False,
) -> list[int]:
    """Indices of kept context tokens, ascending: best units first, at most ``n_keep`` tokens.

    Units are never cut (``cut_last=True``: the first one that does not fit is cut to its head
    and selection stops, the fixed-chunk rule that fills the budget exactly). Ties go to the
    earlier unit; NaN scores rank last. ``neighbours``: see the module docstring.
    """
    if len(chunk_scores) != len(chunks):
        raise ValueError("one score per chunk expected")
    s = [(-math.inf if math.isnan(v) else v) for v in chunk_scores.tolist()]
    order = sorted(range(len(chunks)), key=lambda j: (-s[j], j))
    taken = [False] * len(chunks)
    kept: list[int] = []
    left = n_keep

    def take(j: int) -> bool:
        nonlocal left
        if taken[j] or len(chunks[j]) > left:
            return False
        taken[j] = True
        kept.extend(range(chunks[j].start, chunks[j].end))
        left -= len(chunks[j])
        return True

    for j in order:
        if left <= 0:
            break
        if taken[j]:
            continue
        if not take(j):
            if cut_last:
                c = chunks[j]
                kept.extend(range(c.start, c.start + left))
                break
            continue
        for d in range(1, neighbours + 1):
            for k in (j - d, j + d):
                if 0 <= k < len(chunks):
                    take(k)
    return sorted(kept)
