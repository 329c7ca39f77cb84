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

:func:`choose_branches` chooses for one row on the host; :func:`choose_rows` makes the same
choice for R rows at once as tensors on the scores' device (no value read back: a packed
drafter feeds the chosen outcomes straight into its branch forward), each row's draft padded
to K with its verified length saying how much of it counts.

Letters: R rows, K draft length, V vocabulary (the drafter's draft space), n branches.
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
            if best.values[k] > float("-inf"):  # a position with no outcome takes no branch
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


@dataclass(frozen=True)
class Choice:
    """n outcomes per row as tensors on the scores' device: ``k``, ``r`` (draft-space) and
    ``logp`` [R, n]; ``logp`` -inf marks a pad (the row has fewer than n outcomes)."""

    k: torch.Tensor
    r: torch.Tensor
    logp: torch.Tensor


def outcome_logp_rows(
    draft: torch.Tensor, dist: torch.Tensor, verified: torch.Tensor
) -> torch.Tensor:
    """:func:`outcome_logp` of R rows at once: draft [R, K] (padded), dist [R, K+1, V] (zero
    rows past a row's outcomes), verified [R] (drafts the target checks, m_r <= K) ->
    [R, K+1, V], -inf at k > m_r and at r == d_{k+1} for k < m_r."""
    rows, k = draft.shape
    logd = dist.float().log()
    log_c = logd[:, :k].gather(2, draft[:, :, None]).squeeze(2)  # [R, K]: log c_j
    prefix = torch.cat([log_c.new_zeros(rows, 1), log_c.cumsum(1)], dim=1)  # [R, K+1]
    scores = prefix[:, :, None] + logd
    at = torch.arange(k + 1, device=draft.device)
    accept = torch.zeros_like(scores, dtype=torch.bool)
    accept[:, :k].scatter_(2, draft[:, :, None], True)
    accept &= (at[None, :] < verified[:, None])[:, :, None]
    beyond = (at[None, :] > verified[:, None])[:, :, None]
    return scores.masked_fill(accept | beyond, float("-inf"))


def choose_rows(
    draft: torch.Tensor, dist: torch.Tensor, verified: torch.Tensor, n: int, cover: bool = False
) -> Choice:
    """The n most likely outcomes of each of R rows (:func:`choose_branches`' rule, as
    tensors; shapes as :func:`outcome_logp_rows`)."""
    scores = outcome_logp_rows(draft, dist, verified)  # [R, P, V], P = K+1
    rows, p, v = scores.shape
    flat = scores.flatten(1)  # [R, P*V]
    n = min(n, flat.shape[1])
    if cover:
        best = scores.max(dim=2)  # [R, P]
        m = min(n, p)
        top = best.values.topk(m, dim=1)  # the positions, most likely first
        first = top.indices * v + best.indices.gather(1, top.indices)  # [R, m]
        covered = (top.values > float("-inf")).sum(1, keepdim=True)  # [R, 1]
        # a position with no outcome's "best" is already -inf: masking it again is harmless
        rest = flat.scatter(1, first, float("-inf")).topk(n, dim=1).indices  # [R, n]
        at = torch.arange(n, device=flat.device)[None, :]
        fill = rest.gather(1, (at - covered).clamp_min(0))
        first = torch.cat([first, first.new_zeros(rows, n - m)], dim=1)
        idx = torch.where(at < covered, first, fill)
    else:
        idx = flat.topk(n, dim=1).indices
    return Choice(idx // v, idx % v, flat.gather(1, idx))
