"""The decoding modes as small strategy objects: what each round proposes for the target to verify.

The engine's scheduler (:mod:`d3d.engine.scheduler`) runs every request, alone or in a batch, as
rounds of::

    proposal = proposer.propose(tokens)                 # K draft tokens (K may be 0)
    acc = accept(target logits over [anchor, d_1..d_K]) # one batched forward, d3d.decoding.verify.accept
    proposer.observe(acc, verify_s)                     # what was committed

Modes differ only in the proposer (a strategy, never a flag threaded through the loop):

- :class:`ArProposer` -- proposes nothing, so a round is one plain decode step of the target.
- :class:`SyncProposer` -- the drafter drafts K = B-1 tokens now, on the critical path.
- :class:`d3d.worker.AsyncProposer` -- hands back a block the drafter prepared on its own device
  while the target verified the previous one (see :mod:`d3d.worker`).
- :class:`d3d.decoding.policy.AutoProposer` -- switches speculation on and off from measured costs.

Invariants: both models' caches hold the committed tokens except the last one (the anchor of the
next round); the last token of every round comes from the target; only token ids cross from
drafter to target (plus q when sampling). The prefill is round 0: its one token is reported to
the proposer through :meth:`Proposer.observe` like any other round's.

Letters: K draft length, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from d3d.backends.clock import WALL, Clock
from d3d.config import SamplingConfig
from d3d.decoding.verify import Acceptance
from d3d.model.drafter import Draft

__all__ = ["NO_DRAFT", "ArProposer", "Proposal", "Proposer", "SyncProposer"]


@dataclass(frozen=True)
class Proposal:
    """What a proposer hands the target for one round.

    ``tokens`` [K] draft ids (K = 0: a plain decode step); ``q`` [K, V] the distributions they
    were sampled from (sampling only); ``wait_s`` the drafting time spent on the critical path;
    ``hit``/``branches`` as in :class:`d3d.decoding.stats.Round`.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    wait_s: float = 0.0
    hit: bool | None = None
    branches: int = 0
    failed: bool = False  # the drafter worker failed during this round (counted once)
    source: str = (
        "drafter"  # or "copy": tokens copied from the request's text (d3d.decoding.lookup)
    )

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    def first(self, n: int | None) -> Proposal:
        """The proposal cut to its first ``n`` drafts (None: all of them)."""
        if n is None or n >= self.k:
            return self
        q = None if self.q is None else self.q[:n]
        return replace(self, tokens=self.tokens[:n], q=q)


NO_DRAFT = Proposal(tokens=torch.zeros(0, dtype=torch.long))


class Proposer(Protocol):
    """One decoding mode: proposes draft tokens, and is told what each round committed."""

    name: str
    speculating: bool  # its next round drafts on the drafter worker's cores
    failed: bool  # its drafter worker failed: it proposes nothing more for this request

    def start(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        draft_prompt_ids: Sequence[int] | None = None,
        first_len: int | None = None,
    ) -> None:
        """Begin a request. ``draft_prompt_ids``: what the drafter should read as the prompt
        when it differs from the target's (a compressed prompt for the target, the whole
        document for the drafter). ``first_len``: how many drafts the first round after the
        prefill will verify, as ``observe``'s ``next_len`` (0 lets a worker stay idle)."""
        ...

    def batch(self, share_s: float | None, token_s: float | None = None) -> None:
        """Told before each step: this row's share of the step about to run among the rows that
        share it (None: alone), and what one more token of that forward costs. A mode that
        prices its rounds (``auto``) weighs them against it; the others ignore it."""
        ...

    def propose(self, tokens: list[int]) -> Proposal: ...

    def observe(self, acc: Acceptance, verify_s: float, next_len: int | None = None) -> None:
        """Round done: ``acc`` committed, the target took ``verify_s`` (round 0, the prefill:
        the time for the whole prompt, a cached prefix priced like the rest). ``next_len``: how many
        drafts the next round will verify (None: a whole block; 0: none), which an adaptive
        proposer sets and a worker uses to prepare only what will be used."""
        ...

    def close(self) -> None: ...


def _draft_view(
    tokens: Sequence[int], prompt_len: int, draft_prompt: Sequence[int] | None
) -> Sequence[int]:
    """The drafter's context: its own prompt followed by the tokens generated so far."""
    if draft_prompt is None:
        return tokens
    return [*draft_prompt, *tokens[prompt_len:]]


class ArProposer:
    """Plain autoregressive decoding of the target: proposes nothing."""

    name = "ar"
    speculating = False
    failed = False

    def start(self, prompt_ids, sampling, generator, draft_prompt_ids=None, first_len=None) -> None:
        pass

    def batch(self, share_s: float | None, token_s: float | None = None) -> None:
        pass

    def propose(self, tokens: list[int]) -> Proposal:
        return NO_DRAFT

    def observe(self, acc: Acceptance, verify_s: float, next_len: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class Drafter(Protocol):
    """Anything that opens per-request drafting sessions (the D3D drafter, or a test double)."""

    def session(
        self, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftSource: ...


class DraftSource(Protocol):
    """A per-request drafter: committed token ids in, one :class:`Draft` of K tokens out."""

    def draft(self, token_ids: Sequence[int]) -> Draft: ...


class SyncProposer:
    """Draft a block now, then let the target verify it: drafting sits on the critical path."""

    name = "sync"
    speculating = False  # it drafts in this process: the target keeps every core
    failed = False  # no worker to lose

    def __init__(self, drafter: Drafter, clock: Clock = WALL):
        self.drafter = drafter
        self.clock = clock

    def start(self, prompt_ids, sampling, generator, draft_prompt_ids=None, first_len=None) -> None:
        self.session = self.drafter.session(sampling, generator)
        self.prompt_len = len(prompt_ids)
        self.draft_prompt = list(draft_prompt_ids) if draft_prompt_ids is not None else None
        self.next_len: int | None = None

    def batch(self, share_s: float | None, token_s: float | None = None) -> None:
        pass

    def propose(self, tokens: list[int]) -> Proposal:
        t0 = self.clock.now()
        draft = self.session.draft(_draft_view(tokens, self.prompt_len, self.draft_prompt))
        return Proposal(draft.tokens, draft.q, wait_s=self.clock.now() - t0).first(self.next_len)

    def observe(self, acc: Acceptance, verify_s: float, next_len: int | None = None) -> None:
        self.next_len = next_len

    def close(self) -> None:
        pass
