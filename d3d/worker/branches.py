"""Which outcomes of a verification round to prepare the next block for (pure functions).

While the target verifies a draft ``d_1..d_K``, the drafter guesses how the round will end: k
drafts accepted, then the target's own token r (a correction at position k+1, or the bonus after
a fully accepted draft, k = K). From its own per-position distributions ``dist_k`` (``dist_k``
predicts the token at draft position k+1) and its confidences ``c_j = dist_{j-1}(d_j)``:

    P(k)    = prod_{j<=k} c_j * (1 - c_{k+1})                  (k < K)
    P(k, r) = prod_{j<=k} c_j * dist_k(r),   r != d_{k+1}       (k < K)
    P(K, r) = prod_{j<=K} c_j * dist_K(r)                       (the bonus guess)

(``dist_k(r)`` for r != d_{k+1} sums to ``1 - c_{k+1}``, so the pairs split P(k) among the
candidate tokens.) The branches worth drafting are the most likely pairs. ``cover=True`` first
takes each position's best pair (most likely positions first), the published method's
coverage rule, then fills the budget with the most likely remaining pairs.

Letters: K draft length, V vocabulary (the drafter's draft space).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Outcome:
    """A predicted end of a round: ``k`` drafts accepted, then token ``r``; its probability."""

    k: int
    r: int
    p: float


def outcome_logp(draft: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """log P(k, r) for every k in 0..K and token r: draft [K], dist [K+1, V] -> [K+1, V].

    Pairs that are not outcomes (r == d_{k+1}: that is an acceptance, not a stop) get -inf.
    """
    k = draft.shape[0]
    if dist.shape[0] != k + 1:
        raise ValueError(f"dist must have K+1={k + 1} rows, got {dist.shape[0]}")
    logd = dist.float().log()  # zero probability: -inf, never chosen
    log_c = logd[torch.arange(k), draft] if k else logd.new_zeros(0)  # [K]
    prefix = torch.cat([log_c.new_zeros(1), log_c.cumsum(0)])  # [K+1]: sum_{j<=k} log c_j
    scores = prefix.unsqueeze(1) + logd
    if k:
        scores[torch.arange(k), draft] = float("-inf")
    return scores


def choose_branches(
    draft: torch.Tensor, dist: torch.Tensor, n: int, cover: bool = False
) -> list[Outcome]:
    """The n most likely outcomes (see the module docstring), most likely first."""
    if n <= 0:
        return []
    scores = outcome_logp(draft, dist)  # [K+1, V]
    v = scores.shape[1]
    picked: list[int] = []
    if cover:
        best = scores.max(dim=1)
        order = best.values.argsort(descending=True)
        for k in order[:n].tolist():
            picked.append(k * v + int(best.indices[k]))
    if len(picked) < n:
        flat = scores.flatten().clone()
        if picked:
            flat[torch.tensor(picked)] = float("-inf")
        top = flat.topk(min(n - len(picked), flat.numel()))
        picked += [
            int(i) for i, s in zip(top.indices, top.values, strict=True) if s > -float("inf")
        ]
    out = [Outcome(k=i // v, r=i % v, p=float(scores.flatten()[i].exp())) for i in picked]
    return sorted(out, key=lambda o: -o.p)
