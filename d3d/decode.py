"""The decode loop: prefill, then rounds of {propose, verify, accept, commit, emit, stop?}.

:func:`decode` is one generator shared by every mode; it yields the tokens each round commits, so
streaming and batch callers use the same loop. What differs between modes is a small
:class:`Proposer` object that runs one round against the target:

- :class:`ArProposer` — the target alone, one token per round (the baseline).
- :class:`SyncProposer` — the drafter proposes K = B-1 tokens, the target verifies them in one
  forward over ``[anchor, d_1..d_K]``, the acceptance rule keeps a prefix plus the target's token.

Invariants: both models' caches hold the committed tokens except the last one (the anchor of the
next round); the last token of every round comes from the target; only token ids cross from
drafter to target (plus q when sampling).

Letters: S cached length, T new tokens, K draft length, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from d3d.config import DecodeConfig, SamplingConfig
from d3d.drafter import Draft
from d3d.hf import cache_length, trim_cache, with_cache
from d3d.sampling import make_generator, pick, probabilities
from d3d.verify import greedy_accept, stochastic_accept


class TargetSession:
    """The target's per-request state: a KV cache of committed tokens except the last."""

    def __init__(self, model: PreTrainedModel, prefill_chunk: int = 4096):
        self.model = model
        self.cache = DynamicCache()
        self.prefill_chunk = prefill_chunk

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Encode the prompt in chunks; logits [V] for the first new token."""
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            logits = self.forward(ids[i : i + self.prefill_chunk], last_only=True)
        assert logits is not None, "prefill needs a non-empty prompt"
        return logits[-1]

    def rollback(self, n: int) -> None:
        """Forget the last n cached positions (rejected draft tokens)."""
        trim_cache(self.cache, n)


@dataclass(frozen=True)
class Round:
    """What one round did: ``tokens`` emitted (the last from the target), drafts and timings."""

    tokens: list[int]
    num_drafted: int = 0
    num_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0


class Proposer(Protocol):
    """One decoding mode: runs a round against the target and reports what it committed."""

    name: str

    def start(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None: ...

    def round(self, target: TargetSession, tokens: list[int]) -> Round: ...


class ArProposer:
    """Plain autoregressive decoding of the target: one token per round."""

    name = "ar"

    def start(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self.sampling, self.generator = sampling, generator

    def round(self, target: TargetSession, tokens: list[int]) -> Round:
        t0 = time.perf_counter()
        logits = target.forward(tokens[-1:])[-1]
        token = pick(logits, self.sampling, self.generator)
        return Round(tokens=[token], verify_s=time.perf_counter() - t0)


class Drafter(Protocol):
    """Anything that opens per-request drafting sessions (the D3D drafter, or a test double)."""

    def session(
        self, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftSource: ...


class DraftSource(Protocol):
    """A per-request drafter: committed token ids in, one :class:`Draft` of K tokens out."""

    def draft(self, token_ids: Sequence[int]) -> Draft: ...


class SyncProposer:
    """Draft a block, then verify it: drafter and target take turns on the critical path."""

    name = "sync"

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def start(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self.sampling, self.generator = sampling, generator
        self.session = self.drafter.session(sampling, generator)

    def round(self, target: TargetSession, tokens: list[int]) -> Round:
        t0 = time.perf_counter()
        draft = self.session.draft(tokens)
        t1 = time.perf_counter()
        d = draft.tokens.to(target.device)  # [K]
        logits = target.forward([tokens[-1], *d.tolist()])  # [K+1, V]
        if self.sampling.greedy:
            acc = greedy_accept(d, logits.argmax(dim=-1))
        else:
            p = probabilities(logits, self.sampling)
            acc = stochastic_accept(d, draft.q.to(target.device), p, self.generator)
        k = d.shape[0]
        target.rollback(k - acc.num_accepted)
        return Round(acc.tokens, k, acc.num_accepted, t1 - t0, time.perf_counter() - t1)


@dataclass
class DecodeStats:
    """Per-request statistics; the draft counters use vLLM's metric names."""

    mode: str
    prompt_tokens: int = 0
    num_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    stop_reason: str = ""

    def record(self, rnd: Round) -> None:
        self.draft_seconds += rnd.draft_s
        self.verify_seconds += rnd.verify_s
        if rnd.num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += rnd.num_drafted
        self.num_accepted_tokens += rnd.num_accepted
        if len(self.accepted_per_position) < rnd.num_drafted:
            self.accepted_per_position += [0] * (rnd.num_drafted - len(self.accepted_per_position))
        for i in range(rnd.num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verification round, bonus included (1.0 for ar)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "num_tokens": self.num_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_length": round(self.acceptance_length, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "stop_reason": self.stop_reason,
        }


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
) -> Iterator[list[int]]:
    """Generate after ``prompt_ids``, yielding the tokens each round commits.

    ``stats`` (optional) is filled in as the loop runs and is complete when the generator ends.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    stats = stats if stats is not None else DecodeStats(mode=proposer.name)
    stats.prompt_tokens = len(prompt_ids)
    target = TargetSession(model)
    generator = make_generator(cfg.sampling, target.device)
    proposer.start(cfg.sampling, generator)

    t0 = time.perf_counter()
    first = pick(target.prefill(prompt_ids), cfg.sampling, generator)
    t1 = time.perf_counter()
    stats.prefill_seconds = t1 - t0

    tokens, emitted = list(prompt_ids), [first]
    while True:
        emitted, reason = _clip(emitted, eos_ids, cfg.max_new_tokens - stats.num_tokens)
        tokens += emitted
        stats.num_tokens += len(emitted)
        stats.decode_seconds = time.perf_counter() - t1
        yield emitted
        if reason:
            stats.stop_reason = reason
            return
        rnd = proposer.round(target, tokens)
        stats.record(rnd)
        emitted = rnd.tokens
