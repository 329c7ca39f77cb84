"""The decode loop: prefill, then rounds of {propose, verify, observe, emit, stop?}.

:func:`decode` is one generator shared by every mode; it yields the tokens each round commits, so
streaming and batch callers use the same loop. It reads as the algorithm::

    proposal = proposer.propose(tokens)                      # K draft tokens (K may be 0)
    acc = verify_round(target, anchor, proposal, sampling)   # one target forward, rollback inside
    proposer.observe(acc)                                    # what was committed

The verify/accept/rollback code exists once, in :func:`verify_round`. Modes differ only in the
small proposer object passed in (a strategy, never a flag threaded through the loop):

- :class:`ArProposer` — proposes nothing, so a round is one plain decode step of the target.
- :class:`SyncProposer` — the drafter drafts K = B-1 tokens now, on the critical path.
- :class:`d3d.pipeline.AsyncProposer` — hands back a block the drafter prepared on its own device
  while the target verified the previous one (see :mod:`d3d.pipeline`).
- :class:`d3d.policy.AutoProposer` — switches speculation on and off from measured costs.

Invariants: both models' caches hold the committed tokens except the last one (the anchor of the
next round); the last token of every round comes from the target; only token ids cross from
drafter to target (plus q when sampling). The prefill is round 0: its one token is reported to
the proposer through :meth:`Proposer.observe` like any other round's.

Letters: S cached length, T new tokens, K draft length, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from d3d.config import DecodeConfig, SamplingConfig
from d3d.drafter import Draft
from d3d.hf import cache_length, trim_cache, with_cache
from d3d.kv_store import PrefixCache
from d3d.sampling import make_generator, pick, probabilities
from d3d.stats import DecodeStats, Round
from d3d.verify import Acceptance, greedy_accept, stochastic_accept

__all__ = [
    "ArProposer",
    "DecodeStats",
    "Proposal",
    "Proposer",
    "Round",
    "SyncProposer",
    "TargetSession",
    "decode",
    "verify_round",
]


class TargetSession:
    """The target's per-request state: a KV cache of committed tokens except the last."""

    def __init__(
        self,
        model: PreTrainedModel,
        prefill_chunk: int = 4096,
        prefix_cache: PrefixCache | None = None,
    ):
        self.model = model
        self.cache = DynamicCache()
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache
        self.reused = 0  # prompt tokens whose KV the prefix cache supplied

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append ids [T] to the cache; logits [T, V] (or [1, V] with ``last_only``)."""
        s = cache_length(self.cache)
        x = torch.tensor([list(ids)], device=self.device)
        pos = torch.arange(s, s + x.shape[1], device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=x,
            position_ids=pos,
            logits_to_keep=1 if last_only else 0,
            **with_cache(self.model, self.cache),
        )
        return out.logits[0]

    def prefill(self, ids: Sequence[int], shared: int = 0) -> torch.Tensor:
        """Encode the prompt in chunks; logits [V] for the first new token. ``shared``: the
        first tokens form a prefix other requests share (:class:`~d3d.kv_store.PrefixCache`):
        encoded on their own (or taken from the cache), then the rest."""
        if self.prefix_cache is not None and 0 < shared < len(ids):
            head = ids[:shared]
            cached = self.prefix_cache.lookup(head)
            if cached is not None:
                self.cache, self.reused = cached, shared
            else:
                self.encode(head)
                self.prefix_cache.store(head, self.cache)
            ids = ids[shared:]
        return self.encode(ids)

    def encode(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` to the cache in chunks; logits [V] after the last one."""
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            logits = self.forward(ids[i : i + self.prefill_chunk], last_only=True)
        assert logits is not None, "prefill needs a non-empty prompt"
        return logits[-1]

    def rollback(self, n: int) -> None:
        """Forget the last n cached positions (rejected draft tokens)."""
        trim_cache(self.cache, n)


@dataclass(frozen=True)
class Proposal:
    """What a proposer hands the target for one round.

    ``tokens`` [K] draft ids (K = 0: a plain decode step); ``q`` [K, V] the distributions they
    were sampled from (sampling only); ``wait_s`` the drafting time spent on the critical path;
    ``hit``/``branches`` as in :class:`d3d.stats.Round`.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    wait_s: float = 0.0
    hit: bool | None = None
    branches: int = 0
    failed: bool = False  # the drafter worker failed during this round (counted once)
    source: str = "drafter"  # or "copy": tokens copied from the request's text (d3d.lookup)

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

    def propose(self, tokens: list[int]) -> Proposal: ...

    def observe(self, acc: Acceptance, verify_s: float, next_len: int | None = None) -> None:
        """Round done: ``acc`` committed, the target took ``verify_s`` (round 0, the prefill:
        the time for the whole prompt, a cached prefix priced like the rest). ``next_len``: how many
        drafts the next round will verify (None: a whole block; 0: none), which an adaptive
        proposer sets and a worker uses to prepare only what will be used."""
        ...

    def close(self) -> None: ...


@torch.inference_mode()
def verify_round(
    target: TargetSession,
    anchor: int,
    proposal: Proposal,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Acceptance:
    """One target forward over ``[anchor, d_1..d_K]``; accept, then roll the cache back past the
    rejected drafts. With K = 0 this is one plain decode step."""
    d = proposal.tokens.to(target.device)  # [K]
    logits = target.forward([anchor, *d.tolist()])  # [K+1, V]
    if sampling.greedy:
        acc = greedy_accept(d, logits.argmax(dim=-1))
    else:
        p = probabilities(logits, sampling)
        q = proposal.q
        q = p.new_zeros(0, p.shape[-1]) if q is None else q.to(p.device, p.dtype)
        acc = stochastic_accept(d, q, p, generator)
    target.rollback(proposal.k - acc.num_accepted)
    return acc


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

    def start(self, prompt_ids, sampling, generator, draft_prompt_ids=None, first_len=None) -> None:
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

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def start(self, prompt_ids, sampling, generator, draft_prompt_ids=None, first_len=None) -> None:
        self.session = self.drafter.session(sampling, generator)
        self.prompt_len = len(prompt_ids)
        self.draft_prompt = list(draft_prompt_ids) if draft_prompt_ids is not None else None
        self.next_len: int | None = None

    def propose(self, tokens: list[int]) -> Proposal:
        t0 = time.perf_counter()
        draft = self.session.draft(_draft_view(tokens, self.prompt_len, self.draft_prompt))
        return Proposal(draft.tokens, draft.q, wait_s=time.perf_counter() - t0).first(self.next_len)

    def observe(self, acc: Acceptance, verify_s: float, next_len: int | None = None) -> None:
        self.next_len = next_len

    def close(self) -> None:
        pass


def _clip(tokens: list[int], eos_ids: set[int], room: int) -> tuple[list[int], str]:
    """Cut a round's tokens at the first EOS (kept) or at the token budget."""
    for i, t in enumerate(tokens[:room]):
        if t in eos_ids:
            return tokens[: i + 1], "eos"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, ""


def decode(
    model: PreTrainedModel,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    cfg: DecodeConfig,
    eos_ids: set[int],
    stats: DecodeStats | None = None,
    draft_prompt_ids: Sequence[int] | None = None,
    shared_prefix: int = 0,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[list[int]]:
    """Generate after ``prompt_ids``, yielding the tokens each round commits.

    ``stats`` (optional) is filled in as the loop runs and is complete when the generator ends.
    Closing the generator early (a cancelled request) closes the proposer too.
    ``shared_prefix``: how many first prompt tokens other requests share; their KV is kept in
    (and taken from) ``prefix_cache``.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    stats = stats if stats is not None else DecodeStats(mode=proposer.name)
    stats.prompt_tokens = len(prompt_ids)
    target = TargetSession(model, prefix_cache=prefix_cache)
    sampling = cfg.sampling
    generator = make_generator(sampling, target.device)
    proposer.start(prompt_ids, sampling, generator, draft_prompt_ids)
    try:
        t0 = time.perf_counter()
        first = pick(target.prefill(prompt_ids, shared_prefix), sampling, generator)
        t1 = time.perf_counter()
        stats.prefill_seconds = t1 - t0
        stats.cached_prompt_tokens = target.reused
        # Round 0 reports the whole prompt's prefill, a cached prefix priced at the rate of the
        # tokens encoded now, so proposers read a cost per prompt token from it.
        encoded = max(len(prompt_ids) - target.reused, 1)
        proposer.observe(
            Acceptance(num_accepted=0, tokens=[first]), (t1 - t0) * len(prompt_ids) / encoded
        )

        tokens = list(prompt_ids)
        emitted, reason = _clip([first], eos_ids, cfg.max_new_tokens)
        while True:
            tokens += emitted
            stats.num_tokens += len(emitted)
            stats.decode_seconds = time.perf_counter() - t1
            yield emitted
            if reason:
                stats.stop_reason = reason
                return
            proposal = proposer.propose(tokens)
            tv = time.perf_counter()
            acc = verify_round(target, tokens[-1], proposal, sampling, generator)
            verify_s = time.perf_counter() - tv
            proposer.observe(acc, verify_s)
            emitted, reason = _clip(acc.tokens, eos_ids, cfg.max_new_tokens - stats.num_tokens)
            stats.record(
                Round(
                    emitted,
                    proposal.k,
                    acc.num_accepted,
                    proposal.wait_s,
                    verify_s,
                    proposal.hit,
                    proposal.branches,
                    speculative=proposal.k > 0,
                    failed=proposal.failed,
                    copied=proposal.source == "copy",
                )
            )
    finally:
        proposer.close()
