"""What a caller hands the batched engine, and the per-row state the engine keeps for it.

A :class:`GenRequest` carries token ids in and two callbacks out: ``on_tokens`` with every chunk
of committed tokens (called on the engine's thread, between rounds) and ``on_finish`` once, with
the request's :class:`DecodeStats` and the error that ended it, if any. ``cancel()`` may be called
from any thread; the engine drops the row before its next round.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from d3d.config import SamplingConfig
from d3d.decode import DecodeStats, DraftSource

_ids = itertools.count()


def _noop_tokens(_: list[int]) -> None:
    return None


def _noop_finish(_: DecodeStats, __: BaseException | None) -> None:
    return None


@dataclass
class GenRequest:
    """One generation: prompt ids, budget, sampling, mode (``ar``, ``auto`` or speculative)."""

    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    mode: str = "auto"
    shared_prefix: int = 0  # first prompt tokens other requests share (their KV is cached)
    on_tokens: Callable[[list[int]], None] = _noop_tokens
    on_finish: Callable[[DecodeStats, BaseException | None], None] = _noop_finish
    id: int = field(default_factory=lambda: next(_ids))
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


@dataclass
class Row:
    """A running request: its slot in the cache and everything its rounds need.

    Invariant (as in :mod:`d3d.decode`): the cache holds ``tokens`` except the last one, which is
    the anchor of the next round.
    """

    req: GenRequest
    slot: int
    tokens: list[int]
    stats: DecodeStats
    generator: torch.Generator | None
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    drafts: DraftSource | None = None
    acceptance: float | None = None  # running mean of this row's tokens per speculative round

    @property
    def generated(self) -> int:
        return self.stats.num_tokens
