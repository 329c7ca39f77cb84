"""Test doubles for the asynchronous pipeline: a deterministic clock and a scripted worker.

:class:`ScriptedWorker` speaks the worker protocol in-process and synchronously (a reply is
queued the moment its commit is sent), drafting with any drafter double that has
``session(sampling, generator).draft(ids)``. A script says what it does per block: mark it a
hit or a miss, send a stale block first, fail, hang, or die. :class:`FakeClock` makes waits
deterministic: a wait that times out advances the clock by exactly the timeout.
"""

from __future__ import annotations

import itertools
from collections import deque

from d3d.config import SamplingConfig
from d3d.worker.protocol import Block, Close, Commit, Commits, Failed, Open


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


class ScriptedWorker:
    """A :class:`d3d.worker.WorkerLink` whose behaviour per block comes from ``script``
    (one step's :class:`Commits` are taken one commit after another):
    "hit", "miss", "stale" (a stale block, then the right one, a hit), "fail" (a Failed
    reply), "hang" (nothing, ever again) or "die" (the link goes dead). The script repeats its
    last entry."""

    def __init__(self, drafter, script=("hit",), clock: FakeClock | None = None, events=None):
        self.drafter = drafter
        self.script = list(script)
        self.clock = clock or FakeClock()
        self.events = events if events is not None else []
        self.alive = True
        self.blocks = 0
        self.sessions: dict[int, dict] = {}
        self.boxes: dict[int, deque] = {}
        self.closed: list[int] = []
        self.batches: list[list[int]] = []  # the sessions of each Commits message
        self._ids = itertools.count(1)

    def new_session(self) -> int:
        sid = next(self._ids)
        self.boxes[sid] = deque()
        return sid

    def end_session(self, sid: int) -> None:
        self.boxes.pop(sid, None)

    def _next_action(self) -> str:
        action = self.script[min(self.blocks, len(self.script) - 1)]
        self.blocks += 1
        return action

    def send(self, msg) -> None:
        if not self.alive:
            raise ConnectionError("dead")
        if isinstance(msg, Open):
            sampling: SamplingConfig = msg.sampling
            self.sessions[msg.sid] = {
                "ids": list(msg.prompt_ids),
                "draft": self.drafter.session(sampling, None),
                "hung": False,
            }
        elif isinstance(msg, Commits):  # one engine step: every row's commit
            self.batches.append([c.sid for c in msg.items])
            self.events.append(("commits", len(msg.items)))
            for c in msg.items:
                if c.sid in self.sessions:
                    self.send(c)
        elif isinstance(msg, Close):
            self.closed.append(msg.sid)
            self.sessions.pop(msg.sid, None)
        elif isinstance(msg, Commit):
            s = self.sessions[msg.sid]
            s["ids"] += msg.tokens
            if not msg.wants_block or s["hung"]:
                return
            action = self._next_action()
            pos = len(s["ids"])
            if action == "die":
                self.alive = False
                return
            if action == "hang":
                s["hung"] = True
                return
            if action == "fail":
                self.boxes[msg.sid].append(Failed(msg.sid, "scripted failure"))
                return
            tokens = [int(t) for t in s["draft"].draft(s["ids"]).tokens.tolist()]
            if action == "stale":
                self.boxes[msg.sid].append(Block(msg.sid, pos - 1, tokens, True, 2, 0.0))
            hit = action in ("hit", "stale")
            self.boxes[msg.sid].append(Block(msg.sid, pos, tokens, hit, 2, 0.0))

    def recv(self, sid: int, timeout: float):
        box = self.boxes.get(sid)
        if box:
            msg = box.popleft()
            if isinstance(msg, Block):
                self.events.append(("deliver", msg.pos, sid))
            return msg
        if not self.alive:  # like WorkerClient: a dead worker wakes its waiters at once
            return None
        self.clock.advance(timeout)  # nothing will ever come: the wait times out
        return None
