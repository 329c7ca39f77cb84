"""What a caller hands the engine, and the per-row state the scheduler keeps for it.

A :class:`GenRequest` carries token ids in and two callbacks out: ``on_tokens`` with every chunk
of committed tokens (called on the engine's thread, between steps) and ``on_finish`` once, with
the request's :class:`~d3d.decoding.stats.DecodeStats` and the error that ended it, if any. A
request that asks for ``logprobs`` also gets ``on_logprobs`` with each chunk's log-probabilities,
just before ``on_tokens`` with the same chunk. ``cancel()``
may be called from any thread; the scheduler drops the row before its next step.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from d3d.backends.kv import KvRow
from d3d.config import DecodeConfig, SamplingConfig
from d3d.decoding.processors import History
from d3d.decoding.proposers import Proposal, Proposer
from d3d.decoding.stats import DecodeStats
from d3d.sampling import TokenLogprob

_ids = itertools.count()


def _noop_tokens(_: list[int]) -> None:
    return None


def _noop_finish(_: DecodeStats, __: BaseException | None) -> None:
    return None


@dataclass
class GenRequest:
    """One generation: prompt ids, budget, sampling, mode (``ar``, ``sync``, ``async``, ``auto``).

    ``shared_prefix``: the first prompt tokens other requests share (their KV is cached);
    ``draft_prompt_ids``: what the drafter reads as the prompt when it differs from the
    target's (the whole document, while the target reads the kept part); ``copy``: ``auto``
    may verify copies of the request's own text; ``stats``: where the scheduler keeps the
    request's figures (a caller that wants to read them live passes its own); ``logprobs``:
    report each token's log-probability and that many alternatives (None: none).
    """

    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    mode: str = "auto"
    shared_prefix: int = 0
    draft_prompt_ids: list[int] | None = None
    copy: bool = True
    stats: DecodeStats | None = None  # filled in as the request runs (None: the engine makes one)
    on_tokens: Callable[[list[int]], None] = _noop_tokens
    on_finish: Callable[[DecodeStats, BaseException | None], None] = _noop_finish
    logprobs: int | None = None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def of(
        cls,
        prompt_ids: Sequence[int],
        cfg: DecodeConfig,
        stats: DecodeStats | None = None,
        draft_prompt_ids: Sequence[int] | None = None,
        shared_prefix: int = 0,
        mode: str | None = None,
    ) -> GenRequest:
        """A request from one call's decode settings (``mode``: instead of ``cfg.mode``)."""
        mode = mode or cfg.mode
        return cls(
            list(prompt_ids),
            cfg.max_new_tokens,
            cfg.sampling,
            mode,
            shared_prefix=shared_prefix,
            draft_prompt_ids=None if draft_prompt_ids is None else list(draft_prompt_ids),
            copy=cfg.copy,
            stats=stats if stats is not None else DecodeStats(mode=mode),
        )

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


@dataclass(eq=False)
class Row:
    """A running request: its KV pages, its proposer, and where its prompt reading stands.

    Invariant (every mode): once the prompt is read, the KV holds ``tokens`` except the last
    one, which is the anchor of the next round, and the last token of every round comes from
    the target. ``stops``: the ids that end it; ``history``: what its penalties read (None
    when its logits depend on no history).
    """

    req: GenRequest
    kv: KvRow
    proposer: Proposer
    stats: DecodeStats
    generator: torch.Generator | None
    tokens: list[int]
    prefilled: int = 0  # prompt tokens in the KV (a cached prefix included)
    prefill_s: float = 0.0  # target time spent on this row's prompt
    first_token_at: float = 0.0
    prefix_key: str = ""  # the prefix cache's key of the shared prefix ("" until asked)
    stops: set[int] = field(default_factory=set)
    history: History | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled >= len(self.req.prompt_ids)

    @property
    def prompt_left(self) -> int:
        return len(self.req.prompt_ids) - self.prefilled


@dataclass(eq=False)
class RowStep:
    """One row's part of a step: what it feeds the step's one forward and what comes back.

    A decoding row's round feeds its anchor and its ``proposal``'s drafts and keeps every
    position's logits; a row reading its prompt feeds the next chunk (``proposal`` None) and
    keeps only the last position's logits, where that chunk ends the prompt (``last``).
    ``logits`` and ``top`` (the argmax where the step took one) are filled by the forward.
    """

    row: Row
    ids: list[int]
    proposal: Proposal | None = None
    last: bool = False
    logits: torch.Tensor | None = None
    top: list[int] | None = None

    @property
    def keep(self) -> list[int] | None:
        """The positions whose logits the forward returns (None: all)."""
        if self.proposal is not None:
            return None
        return [len(self.ids) - 1] if self.last else []
