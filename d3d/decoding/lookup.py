"""Context lookup: draft tokens copied from the request's own text (prompt-lookup decoding).

Answers about a document copy it: names, numbers, whole sentences. :func:`find_copy` finds the
earlier place in the request's tokens (prompt and output so far) whose tokens end like the
output ends now, the longest such match (up to ``max_ngram`` tokens, at least ``min_ngram``),
the latest one among equals, and proposes the tokens that followed it there. Drafting costs no
model forward, so a round pays as soon as the target's verify forward over the copied tokens
costs less than the plain steps it saves.

:class:`CopyDrafts` decides, per round, whether a copy is worth verifying and how much of it,
with the cost model of ``auto``'s drafter rounds (:mod:`d3d.decoding.policy`): a round that
verifies n copied tokens costs ``t_step + c n`` (the host's plain step and the verify's cost
per extra token) and yields ``E(n)`` tokens, from the conditional acceptance per copied
position that the host measures (:class:`CopyCosts`) by how long the match was (1, 2, 3, 4 or
more tokens: a one-token match is a weak hint, a four-token one is usually a quotation). The
copy's length is ``n* = argmax E(n) / t(n)`` among ``LENGTHS`` up to what the copy has (the
widths auto's drafter rounds use), and the round runs iff it beats a plain step by ``margin``. On this CPU a verify of 2-4 tokens costs ~1.07 plain
steps and of 16 ~1.4: a one-token match in a chat answer (its next token accepted ~25 % of the
time) pays verified short and loses verified whole, while a quotation pays verified whole. A
bucket nothing is known of is taken for a quotation (``prior``, 0.9 a position: its first copy
is verified whole), so a document's answer copies at full length from its first round, and a
chat answer's weak matches shorten within a few rounds; a bucket that loses is tried again
every ``retry_every`` declined matches, at its best length.

A copy is a deterministic draft: its q is one-hot (:func:`one_hot_q`), for which the exact
acceptance rule of :mod:`d3d.decoding.verify` accepts d with probability p(d) and, at a rejection,
samples from p with d removed: still exactly the target's distribution.

Letters: N tokens so far, K draft length, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from d3d.decoding.costs import LENGTHS, PositionStats, expected_tokens
from d3d.decoding.verify import one_hot_q

MAX_NGRAM = 8
BUCKETS = 4  # match lengths 1, 2, 3 and 4-or-more are judged apart


@dataclass(frozen=True)
class Copy:
    """Draft tokens [K] copied from ``source`` (where they follow the match) and how many of
    the last tokens matched there (``ngram``)."""

    tokens: tuple[int, ...]
    ngram: int
    source: int


def find_copy(
    tokens: Sequence[int] | np.ndarray,
    k: int,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = 1,
) -> Copy | None:
    """The continuation of the longest (then latest) earlier match of the last tokens; see the
    module docstring. None when no earlier place matches ``min_ngram`` tokens."""
    # tokens: [N]
    if k < 1 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError("need k >= 1 and 1 <= min_ngram <= max_ngram")
    x = np.asarray(tokens, dtype=np.int64)
    n = x.shape[0]
    if n < min_ngram + 1:
        return None
    # Candidates: positions j < n - 1 holding the last token; each is then checked one more
    # token back per step, and the survivors of the longest check win.
    cand = np.flatnonzero(x[: n - 1] == x[n - 1])
    if cand.size == 0:
        return None
    best, length = cand, 1
    for t in range(1, min(max_ngram, n - 1)):
        ok = cand[cand >= t]
        ok = ok[x[ok - t] == x[n - 1 - t]]
        if ok.size == 0:
            break
        cand, best, length = ok, ok, t + 1
    if length < min_ngram:
        return None
    j = int(best[-1]) + 1  # the latest of the longest matches; its continuation starts here
    return Copy(tuple(int(v) for v in x[j : min(j + k, n)]), length, j)


@dataclass(frozen=True)
class CopyDraft:
    """A copy to verify: tokens [K], q [K, V] when sampling, and its match-length bucket."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    bucket: int


@dataclass
class CopyCosts:
    """What copy rounds achieved on this host (shared by an engine's requests): conditional
    acceptance per copied position by match-length bucket, and the matches declined per bucket
    since it was last tried."""

    accept: list[PositionStats] = field(
        default_factory=lambda: [PositionStats() for _ in range(BUCKETS)]
    )
    skipped: list[int] = field(default_factory=lambda: [0] * BUCKETS)

    def record(self, bucket: int, drafted: int, num_accepted: int) -> None:
        """A copy round's outcome: ``num_accepted`` of ``drafted`` copied tokens accepted."""
        self.accept[bucket].update(drafted, num_accepted)


class CopyDrafts:
    """Per request: a copy to verify now, or None for a plain step (see the module docstring).

    ``retry_every``: declined matches of a losing bucket before it is tried again; ``margin``:
    how much a copy round must beat plain steps by; ``prior``: the acceptance per position
    assumed where nothing is measured."""

    def __init__(
        self,
        costs: CopyCosts,
        max_len: int,
        vocab_size: int,
        retry_every: int = 32,
        margin: float = 0.03,
        prior: float = 0.9,
    ):
        self.costs = costs
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.retry_every = retry_every
        self.margin = margin
        self.prior = prior

    def length(self, bucket: int, have: int, step_s: float, per_token_s: float) -> int:
        """Copied tokens to verify for a match in ``bucket`` with ``have`` tokens to copy: the
        length with the most tokens per second, 0 when it does not beat plain steps (and no
        retry is due)."""
        rates = self.costs.accept[bucket].rates(have, first=self.prior)

        def rate(n: int) -> float:
            return expected_tokens(rates[:n]) / (step_s + per_token_s * n)

        # Only the lengths auto's drafter rounds use: a fresh process builds a kernel for every
        # new forward width once, inside an answer.
        best = max([n for n in LENGTHS if n <= have] or [have], key=rate)
        if rate(best) > (1.0 + self.margin) / step_s:
            return best
        skipped = self.costs.skipped
        skipped[bucket] += 1
        if skipped[bucket] >= self.retry_every:  # a losing bucket is tried again now and then
            skipped[bucket] = 0
            return best
        return 0

    def propose(
        self,
        tokens: Sequence[int],
        step_s: float | None,
        per_token_s: float | None,
        greedy: bool,
    ) -> CopyDraft | None:
        """A copy that pays, cut to the length that pays most, else None. ``step_s``: a plain
        step's measured time (None: not measured yet, so no copy); ``per_token_s``: the verify's
        cost per extra token (None: not measured yet, so the copy is verified whole)."""
        if step_s is None:
            return None
        copy = self.find(tokens, self.max_len, greedy)
        if copy is None or per_token_s is None:
            return copy
        n = self.length(copy.bucket, len(copy.tokens), step_s, per_token_s)
        if n == 0:
            return None
        return copy if n == len(copy.tokens) else self.cut(copy, n)

    @staticmethod
    def cut(copy: CopyDraft, n: int) -> CopyDraft:
        """The first ``n`` tokens of ``copy``."""
        return CopyDraft(copy.tokens[:n], None if copy.q is None else copy.q[:n], copy.bucket)

    def find(self, tokens: Sequence[int], k: int, greedy: bool) -> CopyDraft | None:
        """A copy of up to ``k`` tokens, whether or not it pays (None: no earlier match)."""
        found = find_copy(tokens, min(k, self.max_len))
        if found is None:
            return None
        d = torch.tensor(found.tokens, dtype=torch.long)
        bucket = min(found.ngram, BUCKETS) - 1
        return CopyDraft(d, None if greedy else one_hot_q(d, self.vocab_size), bucket)

    def record(self, draft: CopyDraft, num_accepted: int) -> None:
        """A copy round's outcome: ``num_accepted`` of the draft's tokens accepted."""
        self.costs.record(draft.bucket, len(draft.tokens), num_accepted)
