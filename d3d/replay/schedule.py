"""How the replay corrupts the recorded future: a set mean acceptance, and a set branch hit rate.

The recording is the target's own greedy output, so a block of recorded tokens would be accepted
whole. To replay a mean acceptance length TAU, each round's block is the recorded future with
the token at position k+1 replaced by another one: greedy verification then accepts exactly k
drafts and the target adds the recorded token there, k+1 tokens a round. k is drawn by
:class:`Diffuser`, error diffusion with a seeded jitter: each draw aims at the mean plus the
shortfall so far, so a short run lands close to TAU (within about (spread + 1) / rounds) and
rounds still vary by up to ``spread`` tokens either side, as a real drafter's do. Near the end
of a recording fewer tokens remain: the block shrinks, k is clipped to it, and the shortfall
carries to the next rounds. The branch hits of ``async`` are drawn the same way, as 0 or 1
around HIT.

:class:`Replay` is one request's replay, the same for the ``sync`` session in the engine and the
worker's ``async`` rows, and seeded by the prompt, so both see the same rounds.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from d3d.replay.spec import ReplaySpec

log = logging.getLogger(__name__)

JITTER = 3.0  # the most a round's accepted drafts stray from the mean, either way


class Diffuser:
    """Integers whose running mean follows ``mean`` (see the module docstring).

    :meth:`draw` gives the next value within the caller's range; :meth:`settle` books the value
    that was used, so draws that were clipped (or never used) do not bias the mean.
    """

    def __init__(self, mean: float, spread: float, seed: int):
        self.mean, self.spread = mean, max(spread, 0.0)
        self.carry = 0.0  # sum of (mean - value) over the settled values
        self.rng = random.Random(seed)

    def draw(self, hi: int, lo: int = 0) -> int:
        x = self.mean + self.carry + self.rng.uniform(-self.spread, self.spread)
        return max(lo, min(hi, math.floor(x + 0.5)))

    def settle(self, value: int) -> None:
        self.carry += self.mean - value


def corrupt(future: Sequence[int], k: int, vocab_size: int) -> list[int]:
    """Drafts that greedy verification accepts exactly ``k`` of: ``future`` (the recorded
    tokens) with the token at position k+1 replaced by a neighbouring id; unchanged when k
    covers all of it (then the whole block is accepted and the target adds its bonus)."""
    drafts = [int(t) for t in future]
    if k < len(drafts):
        t = drafts[k]
        drafts[k] = t + 1 if t + 1 < vocab_size else t - 1
    return drafts


@dataclass(frozen=True)
class Planned:
    """A replayed block: ``tokens`` [<= K] drafts, of which the first ``k`` are the recorded
    ones (what the target accepts)."""

    tokens: list[int]
    k: int


EMPTY = Planned([], 0)


class Replay:
    """One request's replay: the recording (prompt + the target's output) and its schedules.

    ``max_drafts``: K; ``vocab_size``: the target's, for the replaced tokens.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        output: Sequence[int],
        spec: ReplaySpec,
        max_drafts: int,
        vocab_size: int,
    ):
        spec.check_block(max_drafts + 1)
        self.prompt_len = len(prompt)
        self.truth = [int(t) for t in (*prompt, *output)]
        self.max_drafts, self.vocab_size = max_drafts, vocab_size
        seed = hash(tuple(self.truth[: self.prompt_len]))  # ints hash alike in every process
        mean = spec.tau - 1.0
        self.accepts = Diffuser(mean, min(JITTER, mean, max_drafts - mean), seed)
        self.hits = Diffuser(spec.hit, 0.5, seed + 1)
        self._checked = 0  # committed tokens already found to follow the recording
        self._off = False
        self._warned = False

    def follows(self, committed: Sequence[int]) -> bool:
        """Whether ``committed`` is still the recording (checked once per token). A request
        whose text left it (another target, dtype or settings than the recording's) gets no
        more drafts: it goes on with plain steps, and a warning says why."""
        if self._off:
            return False
        n = min(len(committed), len(self.truth))
        start = min(self._checked, n)
        if list(committed[start:n]) != self.truth[start:n]:
            self._off = True
            self._warn(f"the text left the recording at token {len(committed)}: record it again")
            return False
        self._checked = n
        return True

    def block(self, n: int) -> Planned:
        """The block after ``n`` committed tokens, its k drawn (not yet settled)."""
        future = self.truth[n : n + self.max_drafts]
        if self._off or not future:
            if not self._off and not self._warned:  # the usual end of a request: no warning
                self._warned = True
                log.info("replay (a measurement instrument): the recording ends here")
            return EMPTY
        k = self.accepts.draw(len(future))
        return Planned(corrupt(future, k, self.vocab_size), k)

    def after(self, committed: Sequence[int]) -> Planned:
        """The block after ``committed`` (none once the text left the recording)."""
        self.follows(committed)
        return self.block(len(committed))

    def settle(self, planned: Planned) -> None:
        """``planned`` was handed to the target: book its k (a round with no drafts is none)."""
        if planned.tokens:
            self.accepts.settle(planned.k)

    def outcome(self, n: int, planned: Planned | None, verified: int | None) -> tuple[int, int]:
        """How the verification of ``planned`` (after ``n`` committed tokens; None: the prefill)
        ends, of which the target verifies the first ``verified`` drafts (None: all): (k, r),
        k drafts accepted and then the target's token r (-1 past the end of the recording)."""
        if planned is None:
            k = 0
        else:
            k = min(planned.k, len(planned.tokens) if verified is None else verified)
        return k, self.truth[n + k] if n + k < len(self.truth) else -1

    def hit(self) -> bool:
        """Whether this round's branches include the true outcome (HIT of the rounds)."""
        h = self.hits.draw(1)
        self.hits.settle(h)
        return bool(h)

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("replay (a measurement instrument): %s", why)


def decoys(k: int, r: int, top: int, n: int, vocab_size: int) -> list[tuple[int, int]]:
    """``n`` outcomes (k', r') of a round other than the true one (k, r): one at each
    position 0..``top`` nearest k first, then other tokens at k. The branches a replay prepares
    besides (or, on a miss, instead of) the true outcome; never served, but they are counted,
    and with a drafter shape they are drafted like any branch."""
    order = sorted(range(top + 1), key=lambda j: (abs(j - k), j))
    out = [(j, (max(r, 0) + 1 + j) % vocab_size) for j in order if j != k]
    step = 1
    while len(out) < n and step < vocab_size:
        out.append((k, (max(r, 0) + step) % vocab_size))
        step += 1
    return [o for o in out if o != (k, r)][:n]
