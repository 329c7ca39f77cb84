"""Context lookup: draft tokens copied from the request's own text (prompt-lookup decoding).

Answers about a document copy it: names, numbers, whole sentences. :func:`find_copy` finds the
earlier place in the request's tokens (prompt and output so far) whose tokens end like the
output ends now, the longest such match (up to ``max_ngram`` tokens, at least ``min_ngram``),
the latest one among equals, and proposes the tokens that followed it there. Drafting costs no
model forward, so a round pays as soon as the target's verify forward over the copied tokens
costs less than the plain steps it saves.

:class:`CopyDrafts` decides, per round, whether a copy is worth verifying, from figures the
host measures (:class:`CopyCosts`, shared by the requests of one engine): the tokens a copy
round emits, by how long the match was (1, 2, 3, 4 or more tokens: a one-token match is a weak
hint, a four-token one is usually a quotation), against the time of a copy round and of a plain
step. A copy is always verified whole (up to the block's length): a verify forward costs
about the same for 2 and for 16 tokens on this CPU and on a GPU, while the first token beyond a
plain step costs the most. A match length whose rounds do not beat plain steps is set aside and
tried again now and then (its rounds cost at most one verify forward more than a plain step).

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

from d3d.decoding.costs import Ema
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
    """What copy rounds achieved on this host (shared by an engine's requests): tokens emitted
    per round by match-length bucket, seconds per copy round, and the rounds tried and set aside
    per bucket since it was last judged."""

    tokens: list[Ema] = field(default_factory=lambda: [Ema(0.2) for _ in range(BUCKETS)])
    tried: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    skipped: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    round_s: Ema = field(default_factory=lambda: Ema(0.2))

    def measured(self, bucket: int, explore: int) -> float | None:
        """Tokens per copy round in ``bucket`` once it has run ``explore`` rounds, else None."""
        tokens = self.tokens[bucket].value
        return None if self.tried[bucket] < explore else tokens

    def record(self, bucket: int, emitted: int, seconds: float | None = None) -> None:
        """A copy round's outcome: ``emitted`` tokens (in ``seconds``, when timed alone)."""
        self.tried[bucket] += 1
        self.tokens[bucket].add(float(emitted))
        if seconds is not None:
            self.round_s.add(seconds)


class CopyDrafts:
    """Per request: a copy to verify now, or None for a plain step (see the module docstring).

    ``explore``: copy rounds each bucket runs before it is judged; ``retry_every``: declined
    matches of a losing bucket before it is tried again; ``margin``: how much a copy round must
    beat plain steps by."""

    def __init__(
        self,
        costs: CopyCosts,
        max_len: int,
        vocab_size: int,
        explore: int = 2,
        retry_every: int = 32,
        margin: float = 0.03,
    ):
        self.costs = costs
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.explore = explore
        self.retry_every = retry_every
        self.margin = margin

    def pays(self, bucket: int, step_s: float) -> bool:
        """Whether a copy round with a match in ``bucket`` beats plain steps (or is due a try)."""
        c = self.costs
        tokens, round_s = c.measured(bucket, self.explore), c.round_s.value
        if tokens is None or round_s is None:
            return True
        if tokens / round_s > (1.0 + self.margin) / step_s:
            return True
        c.skipped[bucket] += 1
        if c.skipped[bucket] >= self.retry_every:  # a losing bucket is tried again now and then
            c.skipped[bucket] = 0
            return True
        return False

    def propose(
        self, tokens: Sequence[int], step_s: float | None, greedy: bool
    ) -> CopyDraft | None:
        """A copy of up to ``max_len`` tokens that pays, else None. ``step_s``: a plain step's
        measured time (None: not measured yet, so no copy)."""
        if step_s is None:
            return None
        copy = self.find(tokens, self.max_len, greedy)
        if copy is None or not self.pays(copy.bucket, step_s):
            return None
        return copy

    def find(self, tokens: Sequence[int], k: int, greedy: bool) -> CopyDraft | None:
        """A copy of up to ``k`` tokens, whether or not it pays (None: no earlier match)."""
        found = find_copy(tokens, min(k, self.max_len))
        if found is None:
            return None
        d = torch.tensor(found.tokens, dtype=torch.long)
        bucket = min(found.ngram, BUCKETS) - 1
        return CopyDraft(d, None if greedy else one_hot_q(d, self.vocab_size), bucket)

    def record(self, draft: CopyDraft, emitted: int, verify_s: float | None) -> None:
        """A copy round's outcome: ``emitted`` tokens in ``verify_s`` seconds (None: it rode
        in a wider forward, so its time is not its own)."""
        self.costs.record(draft.bucket, emitted, verify_s)
