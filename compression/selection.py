"""Keeping the best units of the context up to a token budget.

Pure functions over scores and units (:mod:`compression.units` segments the context). A scorer
gives every context token a score (higher = keep); :func:`pool` turns those into one score per
unit; :func:`select` keeps the best units until the budget is spent and returns the kept token
indices in original order.

Selection keeps units best first and never cuts one: a unit that no longer fits is skipped and
the next best that fits is taken, so the kept count is the budget or a little under it (less
than one unit). Before the next-ranked unit is considered, a chosen unit is extended:

- ``finish=f``: a unit that ends mid-sentence (a piece of a long sentence,
  :attr:`~compression.units.Chunk.mid_sentence`) brings the units up to its sentence's end when
  all of them fit the budget and hold at most ``f`` tokens. A fact that opens a run-on sentence
  then comes with the rest of it; a longer rest is not the sentence's tail but more text (in a
  document without sentence ends it would be the rest of the document), and is left to rank.
- ``neighbours=w``: up to ``w`` units on each side while the budget allows: an answer sentence
  then comes with its surroundings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from compression.units import Chunk

# The share of a document kept when nobody says (the service's `keep_ratio`, `d3d qa --keep`,
# CompressionConfig): on the LongBench sweep it cost under one point against the whole prompt
# (docs/results.md). Its bounds are check_keep_ratio's.
DEFAULT_KEEP_RATIO = 0.1


def check_keep_ratio(keep_ratio: float) -> float:
    """``keep_ratio`` if it lies in (0, 1]: the one rule every entry (the service's fields, the
    compression config, a sweep's ratios) checks; ValueError naming it otherwise."""
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep ratio must be in (0, 1], got {keep_ratio}")
    return keep_ratio


def budget(n: int, keep_ratio: float) -> int:
    """Tokens kept out of ``n`` at ``keep_ratio`` in (0, 1] (at least one when n > 0)."""
    check_keep_ratio(keep_ratio)
    return min(n, max(1 if n else 0, round(keep_ratio * n)))


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
    finish: int = 0,
) -> list[int]:
    """Indices of kept context tokens, ascending: best units first, at most ``n_keep`` tokens.

    Units are never cut (``cut_last=True``: the first one that does not fit is cut to its head
    and selection stops, the fixed-chunk rule that fills the budget exactly). Ties go to the
    earlier unit; NaN scores rank last. ``finish``, ``neighbours``: see the module docstring.
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

    def finish_sentence(j: int) -> None:
        rest, n = [], 0
        while chunks[j].mid_sentence and j + 1 < len(chunks) and n <= finish:
            j += 1
            rest.append(j)
            n += len(chunks[j])
        if n <= finish and sum(len(chunks[k]) for k in rest if not taken[k]) <= left:
            for k in rest:
                take(k)

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
        if finish:
            finish_sentence(j)
        for d in range(1, neighbours + 1):
            for k in (j - d, j + d):
                if 0 <= k < len(chunks):
                    take(k)
    return sorted(kept)
