"""The messages between a request (the target's side) and the drafter worker.

Only token ids cross, plus, when sampling, each block's proposal distribution q as a sparse
top-M table over target token ids (never a full-vocabulary tensor). Every message is a small
frozen dataclass of plain data, so the same objects travel over a thread queue, a test's fake
link, or a socket to another process, where :data:`CODEC` writes them as msgpack tagged by type
(:mod:`d3d.worker.codec`: only these classes are ever built from bytes; never pickle).

Target -> worker: :class:`Open` (a request's drafter prompt), :class:`Commit` (the tokens a
round committed, and how much of a block the next round wants) or :class:`Commits` (one step's
commits of every row in a batch), :class:`Close`.
Worker -> target: :class:`Ready` once the drafter is loaded, :class:`Block` (the draft for the
committed length ``pos``), :class:`Failed`, and from a worker in its own process a :class:`Beat`
every fraction of a second from a thread of its own (a worker that stops beating is hung: see
:mod:`d3d.worker.supervisor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from d3d.config import SamplingConfig
from d3d.worker.codec import Codec


@dataclass(frozen=True)
class Open:
    """A request's drafter prompt. ``prepare``: read it and prepare the first round's branches
    now (False: the first rounds are plain steps, so the worker reads nothing until a block is
    first wanted and leaves the cores to the target)."""

    sid: int
    prompt_ids: list[int]
    sampling: SamplingConfig
    seed: int
    prepare: bool = True
    branches: bool = True  # False: no branches, every block drafted on its commit (``sync``)


@dataclass(frozen=True)
class Commit:
    """``tokens`` committed by the last round (accepted drafts + the target's token);
    ``verify_s``: the round's target time; ``next_len``: how many drafts the next round will
    verify (None: the whole block; 0: none, a plain target step follows)."""

    sid: int
    tokens: list[int]
    verify_s: float
    next_len: int | None = None

    @property
    def wants_block(self) -> bool:
        return self.next_len != 0


@dataclass(frozen=True)
class Commits:
    """One engine step's commits, every speculating row's at once (see
    :class:`~d3d.worker.proposer.BatchedLink`)."""

    items: list[Commit]


@dataclass(frozen=True)
class Close:
    sid: int


@dataclass(frozen=True)
class Stop:
    """Ends the worker loop."""


@dataclass(frozen=True)
class Beat:
    """The worker process is alive (sent by its heartbeat thread, busy or not)."""


@dataclass(frozen=True)
class Ready:
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    sid: int | None
    message: str


@dataclass(frozen=True)
class Block:
    """A draft for the round after ``pos`` committed tokens (the anchor is token ``pos - 1``).

    ``hit``: served from a branch prepared while the previous round was verified (a round
    with no branch prepared is a miss); ``branches``: how many were prepared; ``work_s``: the worker's
    time to produce it after the commit arrived. ``q_ids``/``q_probs`` [K, M]: the proposal
    distribution of each slot (sampling only).
    """

    sid: int
    pos: int
    tokens: list[int]
    hit: bool
    branches: int
    work_s: float
    q_ids: np.ndarray | None = None
    q_probs: np.ndarray | None = None


MESSAGES = (Open, Commit, Commits, Close, Stop, Beat, Ready, Failed, Block, SamplingConfig)
CODEC = Codec(MESSAGES)  # the bytes of every message between processes
