"""``async`` decoding, the target's side: blocks prepared while the previous round was verified.

:class:`AsyncProposer` is the decode loop's proposer for the asynchronous pipeline. It tells the
worker what each round committed (:meth:`observe`, right after verification) and takes the next
block from it (:meth:`propose`). The worker has usually drafted that block already, as a branch,
during the verification; on a miss it drafts it on receipt of the commit. Either way a block for
round t+1 can only exist after round t's commit was sent, i.e. after its verification ended.

With ``branches=False`` the worker prepares nothing ahead: every block is drafted when its
commit arrives, on the critical path (``sync`` for an engine whose own process must not hold
the drafter, such as vLLM's model runner).

Failure is local: if the worker dies, answers with a failure or with a block that cannot be one
(ids outside the vocabulary, more drafts than a block holds), or does not answer within its
timeout, the proposer logs it, counts it (``Proposal.failed``), and proposes nothing from then
on, so the request finishes on the target alone with nothing lost.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from d3d.config import SamplingConfig
from d3d.decoding.proposers import NO_DRAFT, Proposal
from d3d.decoding.verify import Acceptance
from d3d.worker.protocol import Block, Close, Commit, Commits, Failed, Open

log = logging.getLogger(__name__)


class WorkerLink(Protocol):
    """What a proposer needs of a worker (a :class:`~d3d.worker.workers.WorkerClient`, or a
    test's fake)."""

    alive: bool

    def new_session(self) -> int: ...

    def end_session(self, sid: int) -> None: ...

    def send(self, msg: object) -> None: ...

    def recv(self, sid: int, timeout: float) -> object | None: ...


class BatchedLink:
    """A link that holds back each row's :class:`Commit` until :meth:`flush`, then sends a
    step's commits as one :class:`Commits` message: the worker answers every row's block first
    and then prepares every row's branches, within one budget, while the batched verify runs.
    Other messages go out at once (an ``Open`` lets the worker start reading a prompt while the
    target reads it too)."""

    def __init__(self, link: WorkerLink):
        self.link = link
        self.pending: list[Commit] = []

    @property
    def alive(self) -> bool:
        return self.link.alive

    def new_session(self) -> int:
        return self.link.new_session()

    def end_session(self, sid: int) -> None:
        self.link.end_session(sid)

    def send(self, msg: object) -> None:
        if isinstance(msg, Commit):
            self.pending.append(msg)
        else:
            self.link.send(msg)

    def recv(self, sid: int, timeout: float) -> object | None:
        return self.link.recv(sid, timeout)

    def flush(self) -> None:
        """Send the held commits (a worker that is gone fails its rows at their next block)."""
        if self.pending:
            msgs, self.pending = self.pending, []
            with contextlib.suppress(ConnectionError, OSError):
                self.link.send(Commits(msgs))


class AsyncProposer:
    """Proposes the blocks a drafter worker prepares (see the module docstring).

    ``min_timeout``: the shortest wait for a block before the worker counts as hung; the wait
    also scales with the last round's target time (``timeout_factor`` x), which covers the
    drafter's own prefill of a long prompt, and grows with the tokens the worker has not read
    yet (plain steps leave them unread), at three times the target's prefill cost per token.
    """

    name = "async"

    def __init__(
        self,
        link: WorkerLink,
        vocab_size: int,
        min_timeout: float = 5.0,
        timeout_factor: float = 10.0,
        clock=time.perf_counter,
        branches: bool = True,
        max_drafts: int | None = None,
    ):
        """``branches``: prepare blocks ahead (False: ``sync`` on the worker); ``max_drafts``:
        the most drafts a block may hold (None: not checked)."""
        self.link = link
        self.vocab_size = vocab_size
        self.min_timeout = min_timeout
        self.timeout_factor = timeout_factor
        self.clock = clock
        self.branches = branches
        self.max_drafts = max_drafts
        self.sid: int | None = None
        if not branches:
            self.name = "sync"

    def start(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        draft_prompt_ids: Sequence[int] | None = None,
        first_len: int | None = None,
    ) -> None:
        self.sampling = sampling
        self.failed = False
        self.failure_reported = False
        self.expect: int | None = None
        self.next_len: int | None = None
        self.last_target_s = 0.0
        self.per_token_s: float | None = None  # the target's prefill cost per prompt token
        self.device = generator.device if generator is not None else torch.device("cpu")
        prompt = list(draft_prompt_ids if draft_prompt_ids is not None else prompt_ids)
        self.committed = self.prompt_len = len(prompt)
        self.target_len = len(prompt_ids)  # round 0 is the target's prefill of its own prompt
        self.unread = len(prompt) if first_len == 0 else 0  # tokens the worker will catch up on
        if not self.link.alive:
            self._fail("the drafter worker is not running")
            return
        try:
            self.sid = self.link.new_session()
        except (ConnectionError, OSError) as exc:
            self._fail(f"cannot reach the drafter worker: {exc}")
            return
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(62)
        prepare = first_len != 0 and self.branches
        self._send(Open(self.sid, prompt, sampling, seed, prepare=prepare, branches=self.branches))

    @property
    def speculating(self) -> bool:
        return not self.failed

    def observe(self, acc: Acceptance, verify_s: float | None, next_len: int | None = None) -> None:
        self.committed += len(acc.tokens)
        if verify_s is not None:
            self.last_target_s = verify_s
        if self.per_token_s is None:  # the first round is the prefill
            self.per_token_s = self.last_target_s / max(self.target_len, 1)
        if next_len == 0:  # the worker will not read these until a block is wanted
            self.unread += len(acc.tokens)
        if self.failed:
            return
        self.expect = self.committed if next_len != 0 else None
        self.next_len = next_len
        self._send(Commit(self.sid, list(acc.tokens), verify_s or 0.0, next_len))

    def batch(self, share_s: float | None, token_s: float | None = None) -> None:
        pass  # its rounds are the worker's blocks: nothing to price

    def propose(self, tokens: list[int]) -> Proposal:
        if self.failed or self.expect is None:
            return NO_DRAFT
        t0 = self.clock()
        timeout = max(self.min_timeout, self.timeout_factor * self.last_target_s)
        timeout += 3.0 * self.unread * (self.per_token_s or 0.0)
        self.unread = 0
        while True:
            left = timeout - (self.clock() - t0)
            msg = self.link.recv(self.sid, left) if left > 0 else None
            if msg is None:
                why = "is gone" if not self.link.alive else f"sent no block in {timeout:.1f} s"
                return self._fail(f"the drafter worker {why}")
            if isinstance(msg, Failed):
                return self._fail(f"the drafter worker failed: {msg.message}")
            if isinstance(msg, Block) and msg.pos == self.expect:
                break  # anything else is a stale reply of an earlier round
        self.expect = None
        if not self._valid(msg.tokens):
            return self._fail("the drafter worker sent a block that is not one")
        d = torch.tensor(msg.tokens, dtype=torch.long)
        q = None
        if not self.sampling.greedy and msg.q_ids is not None:
            q = torch.zeros(d.shape[0], self.vocab_size, device=self.device)
            q.scatter_(
                1,
                torch.as_tensor(msg.q_ids, dtype=torch.long, device=self.device),
                torch.as_tensor(msg.q_probs, dtype=torch.float32, device=self.device),
            )
        return Proposal(d, q, wait_s=self.clock() - t0, hit=msg.hit, branches=msg.branches).first(
            self.next_len
        )

    def close(self) -> None:
        if self.sid is not None:
            if not self.failed:
                with contextlib.suppress(ConnectionError, OSError):
                    self.link.send(Close(self.sid))
            self.link.end_session(self.sid)
            self.sid = None

    def _valid(self, tokens: object) -> bool:
        """Whether ``tokens`` can be a block: a list of ids in the vocabulary, not too many."""
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return False
        if self.max_drafts is not None and len(tokens) > self.max_drafts:
            return False
        return all(0 <= t < self.vocab_size for t in tokens)

    # ----- failure ----------------------------------------------------------------------
    def _send(self, msg: object) -> None:
        try:
            self.link.send(msg)
        except (ConnectionError, OSError) as exc:
            self._fail(f"cannot reach the drafter worker: {exc}")

    def _fail(self, why: str) -> Proposal:
        if not self.failed:
            log.warning("%s; this request goes on with the target alone", why)
        self.failed = True
        report = not self.failure_reported
        self.failure_reported = True
        return Proposal(NO_DRAFT.tokens, failed=report) if report else NO_DRAFT
