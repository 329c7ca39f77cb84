"""What one request's decoding did: per-round records folded into per-request statistics.

A :class:`Round` is one pass of the decode loop (one target forward); :class:`DecodeStats`
accumulates them. The draft counters use vLLM's metric names (``num_drafts``,
``num_draft_tokens``, ``num_accepted_tokens``, per-position accepted counts; mean acceptance
length = 1 + accepted / drafts); the asynchronous pipeline's own figures (branch hits and
misses, branches prepared per round, hit-round timings) and the adaptive mode's split of tokens
with and without speculation and its copy rounds (drafts copied from the request's own text,
:mod:`d3d.decoding.lookup`; counted in the draft counters too) sit beside them under their own names.

Times: ``draft_s`` is drafting time *on the critical path* (all of it for ``sync``; for ``async``
only the wait for a block that was not ready), ``verify_s`` the target forward with acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Round:
    """One round: ``tokens`` emitted (the last from the target), what was drafted, and timings.

    ``hit`` is None when no prepared branch could have served the round (``ar``, ``sync``, the
    first block of a request), else whether the block came from a branch prepared during the
    previous verification. ``branches`` counts the branches the drafter prepared for the next
    round while this one was verified.
    """

    tokens: list[int]
    num_drafted: int = 0
    num_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    hit: bool | None = None
    branches: int = 0
    speculative: bool = False
    failed: bool = False
    copied: bool = False  # the drafts were copied from the request's text (d3d.decoding.lookup)
    step_s: float = 0.0  # the whole engine step, when every drafting row in it hit (else 0)


@dataclass
class DecodeStats:
    """Per-request statistics, filled in as the decode loop runs."""

    mode: str
    drafter: str = ""  # named only for an instrument (the replay drafter, d3d.replay)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
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
    # asynchronous drafting
    branch_hits: int = 0
    branch_misses: int = 0
    branches_prepared: int = 0
    branch_rounds: int = 0
    hit_round_seconds: float = 0.0
    hit_verify_seconds: float = 0.0
    # Hit steps (every drafting row of the step had its block ready): whole steps vs their
    # verify forwards, i.e. how well the drafting hid.
    hit_steps: int = 0
    hit_step_seconds: float = 0.0
    hit_step_verify_seconds: float = 0.0
    worker_failures: int = 0
    # adaptive speculation: tokens emitted by speculative rounds and by plain target steps
    spec_tokens: int = 0
    ar_tokens: int = 0
    rounds: int = 0
    # copy rounds (drafts copied from the request's text): also counted in the draft counters
    copy_drafts: int = 0
    copy_draft_tokens: int = 0
    copy_accepted_tokens: int = 0

    def record(self, rnd: Round) -> None:
        self.rounds += 1
        self.draft_seconds += rnd.draft_s
        self.verify_seconds += rnd.verify_s
        self.worker_failures += int(rnd.failed)
        if rnd.speculative:
            self.spec_tokens += len(rnd.tokens)
        else:
            self.ar_tokens += len(rnd.tokens)
        if rnd.hit is not None:
            if rnd.hit:
                self.branch_hits += 1
                self.hit_round_seconds += rnd.draft_s + rnd.verify_s
                self.hit_verify_seconds += rnd.verify_s
                if rnd.step_s > 0:
                    self.hit_steps += 1
                    self.hit_step_seconds += rnd.step_s
                    self.hit_step_verify_seconds += rnd.verify_s
            else:
                self.branch_misses += 1
        if rnd.branches:
            self.branches_prepared += rnd.branches
            self.branch_rounds += 1
        if rnd.num_drafted == 0:
            return
        if rnd.copied:
            self.copy_drafts += 1
            self.copy_draft_tokens += rnd.num_drafted
            self.copy_accepted_tokens += rnd.num_accepted
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

    @property
    def hit_rate(self) -> float:
        """Share of rounds that could be served from a prepared branch and were."""
        n = self.branch_hits + self.branch_misses
        return self.branch_hits / n if n else 0.0

    @property
    def branches_per_round(self) -> float:
        return self.branches_prepared / self.branch_rounds if self.branch_rounds else 0.0

    def to_dict(self) -> dict:
        named = {"drafter": self.drafter} if self.drafter else {}
        return {
            "mode": self.mode,
            **named,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
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
            "hit_rate": round(self.hit_rate, 4),
            "branch_hits": self.branch_hits,
            "branch_misses": self.branch_misses,
            "branches_per_round": round(self.branches_per_round, 3),
            "hit_round_seconds": round(self.hit_round_seconds, 4),
            "hit_verify_seconds": round(self.hit_verify_seconds, 4),
            "hit_steps": self.hit_steps,
            "hit_step_seconds": round(self.hit_step_seconds, 4),
            "hit_step_verify_seconds": round(self.hit_step_verify_seconds, 4),
            "worker_failures": self.worker_failures,
            "spec_tokens": self.spec_tokens,
            "ar_tokens": self.ar_tokens,
            "copy_drafts": self.copy_drafts,
            "copy_draft_tokens": self.copy_draft_tokens,
            "copy_accepted_tokens": self.copy_accepted_tokens,
        }
