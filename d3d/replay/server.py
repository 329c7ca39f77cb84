"""The replay in the drafter worker: ``async`` rows served through the worker's real path.

:class:`ReplayServer` stands where :class:`~d3d.worker.server.DraftServer` stands: behind a
:class:`~d3d.worker.workers.ThreadWorker` or in a worker process, reading the same messages
(:mod:`d3d.worker.protocol`) from the same :class:`~d3d.worker.proposer.AsyncProposer`, one
:class:`~d3d.worker.protocol.Commits` a step, and answering with the same
:class:`~d3d.worker.protocol.Block` replies, so hits, misses and their timings reach the stats as
a real drafter's do. What it replaces is the drafter's judgement:

- a block is the recording corrupted to the set acceptance (:class:`~d3d.replay.schedule.Replay`);
- while the target verifies a block, the server knows how the verification will end (the
  recording is the target's own greedy text). It prepares branches keyed as a real drafter's
  are, (committed length, k, r): in a share HIT of the rounds they include that true outcome
  (the next commit is a hit, answered at once), otherwise only other outcomes (a miss: the
  block is drafted when the commit arrives);
- with a drafter shape (:mod:`d3d.replay.shape`) every block and branch forward of that
  drafter runs for real, on the committed tokens, so the worker's time, the branch budget and
  whether branches fit inside the verify are real; without one, blocks cost nothing and each
  round prepares ``max_branches`` branches (or ``fixed_branches``). A row whose slot in the
  shape's packed KV cannot take a step fails alone before the step, as on the D3D worker.

The recording reaches the worker with the request: the target's side sends a
:class:`ReplayOpen` (:class:`~d3d.replay.drafter.ReplayLink`), so a worker in another process
needs nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from d3d.backends.clock import Clock
from d3d.backends.cuda.kv import SlotLimitError
from d3d.model.drafter import D3DDrafter
from d3d.model.meta import DrafterError
from d3d.replay.schedule import Planned, Replay, decoys
from d3d.replay.shape import shape_forwards
from d3d.replay.spec import ReplaySpec
from d3d.worker.budget import BranchBudget
from d3d.worker.protocol import CODEC, Block, Commit, Open
from d3d.worker.server import MessageServer, ServerConfig


class ReplaySource(Protocol):
    """What the server reads of its replay drafter (:class:`~d3d.replay.drafter.ReplayDrafter`):
    the spec, the block and vocabulary sizes, the device, and the shape whose forwards run."""

    spec: ReplaySpec
    block_size: int
    vocab_size: int
    device: torch.device
    shape: D3DDrafter | None


log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (committed length, k accepted, the target's token r)


@CODEC.register  # it crosses to a worker process like any Open
@dataclass(frozen=True)
class ReplayOpen(Open):
    """An :class:`~d3d.worker.protocol.Open` with the recorded output after ``prompt_ids``."""

    output: list[int] = field(default_factory=list)


@dataclass
class _Row:
    replay: Replay
    committed: list[int]
    prepares: bool
    branches: dict[Key, Planned] = field(default_factory=dict)


class ReplayServer(MessageServer):
    """Serves every ``async`` replay row of one engine (see the module docstring)."""

    def __init__(
        self, drafter: ReplaySource, cfg: ServerConfig | None = None, clock: Callable | None = None
    ):
        self.drafter = drafter  # the worker reads its device
        self.cfg = cfg or ServerConfig()
        shape = drafter.shape
        self.forwards = shape_forwards(shape, self.cfg.max_branches) if shape is not None else None
        self.clock = clock or Clock([drafter.device]).now
        self.budget = BranchBudget(self.cfg.max_branches, self.cfg.safety)
        self.rows: dict[int, _Row] = {}
        self.pending: Callable[[], bool] = lambda: False  # set by the worker loop

    @property
    def shapes(self) -> int | None:
        """The shape's packed forwards' step shapes (None: no shape, or one drafted row by row)."""
        packed = getattr(self.forwards, "packed", None)
        return packed.runner.shapes if packed is not None else None

    # ----- messages (MessageServer.handle routes them) ----------------------------------
    def _open(self, msg: Open) -> None:
        if not isinstance(msg, ReplayOpen):
            raise DrafterError("no recording came with this request (a replay worker reads one)")
        d = self.drafter
        replay = Replay(msg.prompt_ids, msg.output, d.spec, d.block_size - 1, d.vocab_size)
        row = _Row(replay, list(msg.prompt_ids), prepares=msg.branches)
        self.rows[msg.sid] = row
        if msg.prepare and msg.branches:
            self._prepare([(msg.sid, row, None, None)])

    def _close(self, sid: int) -> None:
        self.rows.pop(sid, None)
        if self.forwards is not None:
            self.forwards.drop(sid)

    def _commits(self, msgs: list[Commit]) -> Iterator[object]:
        """One step's commits: hits out at once, then the misses' blocks, then every row's
        branches for the next round, while the target verifies."""
        live = []
        for m in msgs:
            row = self.rows.get(m.sid)
            if row is None:
                continue
            try:  # a row the shape's slot cannot step fails alone, before the step
                if self.forwards is not None:
                    self.forwards.check(len(row.committed) + len(m.tokens))
            except SlotLimitError as exc:
                yield self._failed(m.sid, exc)
            else:
                live.append((m, row))
        verify = [m.verify_s for m, row in live if len(row.committed) > row.replay.prompt_len]
        if verify:  # the first commit's time is the prefill's
            self.budget.observe_verify(max(verify))
        wanted: list[tuple[Commit, _Row, Planned | None, int]] = []
        for m, row in live:
            key = (len(row.committed), len(m.tokens) - 1, m.tokens[-1])
            row.committed += m.tokens
            offered, served = len(row.branches), row.branches.get(key)
            row.branches = {}
            if m.wants_block:
                wanted.append((m, row, served, offered))
        ready: list[tuple[Commit, _Row, Planned]] = []
        for m, row, served, offered in wanted:
            if served is not None:  # a hit: the target is waiting
                row.replay.settle(served)
                yield self._block(m, row, served, offered, hit=True, work_s=0.0)
                ready.append((m, row, served))
        misses = [(m, row, offered) for m, row, served, offered in wanted if served is None]
        t0 = self.clock()
        if misses and self.forwards is not None:
            try:  # every missed block in one forward of the drafter shape
                self.forwards.blocks([(m.sid, row.committed) for m, row, _ in misses])
            except Exception as exc:
                for m, _, _ in misses:
                    yield self._failed(m.sid, exc)
                misses = []
        for m, row, offered in misses:
            planned = row.replay.after(row.committed)
            row.replay.settle(planned)
            yield self._block(m, row, planned, offered, hit=False, work_s=self.clock() - t0)
            ready.append((m, row, planned))
        ready = [r for r in ready if r[1].prepares]
        # a row at a time (the row-by-row drafter's forwards), or every row in one forward
        together = self.forwards is not None and self.forwards.together
        for group in [ready] if together else [[r] for r in ready]:
            if self.pending():  # the next step's commits are here: those rounds are over
                break
            try:
                self._prepare([(m.sid, row, p, m.next_len) for m, row, p in group], len(ready))
            except Exception as exc:
                for m, _, _ in group:
                    yield self._failed(m.sid, exc)

    @staticmethod
    def _block(
        msg: Commit, row: _Row, planned: Planned, offered: int, hit: bool, work_s: float
    ) -> Block:
        return Block(msg.sid, len(row.committed), planned.tokens, hit, offered, work_s)

    def _prepare(
        self, items: list[tuple[int, _Row, Planned | None, int | None]], rows: int = 1
    ) -> None:
        """For each (sid, row, ``planned``, ``length``): branches for the outcomes of verifying
        ``planned`` (None: the prefill, whose outcome is the first answer token), the target
        verifying its first ``length`` drafts (None: all); then the shape's forwards for all
        of them at once; ``rows`` share the verify's branch budget."""
        t0 = self.clock()
        n = self._count(rows)
        work = []
        for sid, row, planned, length in items:
            n0, rep = len(row.committed), row.replay
            if not rep.follows(row.committed):
                continue
            k, r = rep.outcome(n0, planned, length)
            drafts = [] if planned is None else planned.tokens[:length]
            outcomes = [(k, r)] if n and r >= 0 and rep.hit() else []
            outcomes += decoys(k, r, len(drafts), n - len(outcomes), self.drafter.vocab_size)
            # The true branch's block is planned now (its k drawn); decoys are never served.
            row.branches = {
                (n0, j, t): rep.block(n0 + j + 1) if (j, t) == (k, r) else Planned([], 0)
                for j, t in outcomes
            }
            if outcomes:
                work.append((sid, row.committed, drafts, outcomes))
        if self.forwards is not None and work:
            reads = self.forwards.branches(work)
            if not reads:  # reading a prompt or a catch-up is no sample of the branch cost
                most = max(len(w[3]) for w in work)
                self.budget.observe_cost(most, (self.clock() - t0) / len(work))

    def _count(self, rows: int) -> int:
        """Branches per row this round: the budget's with a drafter shape (what fits inside the
        verify), else a fixed count."""
        if self.cfg.fixed_branches is not None:
            return self.cfg.fixed_branches
        return self.budget.choose(rows) if self.forwards is not None else self.cfg.max_branches
