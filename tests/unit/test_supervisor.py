"""The drafter worker's supervisor with fake workers and a fake clock: what it does when a
worker dies, stops beating, never gets ready, and how sessions of a lost worker behave."""

from __future__ import annotations

import itertools
import queue
import threading

import pytest

from d3d.worker.protocol import Commit, Commits
from d3d.worker.supervisor import Supervisor, SupervisorConfig
from tests.concurrency.fakes import FakeClock


class FakeWorker:
    pids = itertools.count(100)

    def __init__(self, clock: FakeClock, ready: bool = True, beats: bool = True):
        self.clock = clock
        self.pid = next(self.pids)
        self.dead = False
        self.why = ""
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.beats = beats
        self.last_beat = clock()
        self.killed = self.closed = False
        self._boxes: dict[int, queue.Queue] = {}
        self.sent: list[object] = []
        self._ids = itertools.count(1)
        self.info = {"pid": self.pid}

    @property
    def alive(self) -> bool:
        return not self.dead

    def new_session(self) -> int:
        sid = next(self._ids) + 1000 * self.pid
        self._boxes[sid] = queue.Queue()
        return sid

    def end_session(self, sid: int) -> None:
        self._boxes.pop(sid, None)

    def send(self, msg) -> None:
        if self.dead:
            raise ConnectionError("gone")
        self.sent.append(msg)

    def recv(self, sid, timeout):
        box = self._boxes.get(sid)
        try:
            return box.get_nowait() if box is not None else None
        except queue.Empty:
            return None

    def kill(self) -> None:
        self.killed = True

    def close(self) -> None:
        self.closed = True


def make(cfg=None, **worker_kw):
    clock = FakeClock()
    made: list[FakeWorker] = []

    def start():
        made.append(FakeWorker(clock, **worker_kw))
        return made[-1]

    sup = Supervisor(
        start,
        cfg or SupervisorConfig(hang_s=5, backoff_s=1, max_backoff_s=4),
        clock=clock,
        watch=False,
    )
    sup.check()
    return sup, made, clock


def test_a_worker_that_comes_up_is_reported_up():
    sup, made, _ = make()
    assert sup.state == "up" and sup.alive
    assert sup.status() == {"state": "up", "pid": made[0].pid, "restarts": 0}


def test_a_dead_worker_is_replaced_after_a_backoff_that_doubles():
    sup, made, clock = make()
    sid = sup.new_session()
    made[0].dead = True
    sup.check()
    assert sup.state == "restarting" and not sup.alive and sup.status()["pid"] is None
    assert sup.recv(sid, 1.0) is None, "a request waiting on the lost worker wakes at once"
    with pytest.raises(ConnectionError):
        sup.send(Commit(sid, [1], 0.1))
    with pytest.raises(ConnectionError):
        sup.new_session()
    clock.advance(0.5)
    sup.check()
    assert len(made) == 1, "not before the backoff"
    clock.advance(0.6)
    sup.check()
    sup.check()
    assert len(made) == 2 and sup.state == "up" and sup.restarts == 1
    assert sup.status()["pid"] == made[1].pid != made[0].pid
    made[1].dead = True  # a second loss waits twice as long
    sup.check()
    clock.advance(1.5)
    sup.check()
    assert len(made) == 2
    clock.advance(0.6)
    sup.check()
    assert len(made) == 3 and sup.restarts == 2


def test_a_worker_that_stops_beating_is_killed_and_replaced():
    sup, made, clock = make()
    clock.advance(4.0)
    sup.check()
    assert sup.state == "up", "silent for less than hang_s"
    clock.advance(1.5)
    sup.check()
    assert made[0].killed and sup.state == "restarting"
    assert "heartbeat" in sup.status()["last_error"]
    clock.advance(1.1)
    sup.check()
    sup.check()
    assert sup.state == "up" and sup.restarts == 1


def test_a_thread_worker_is_never_judged_hung():
    sup, made, clock = make(beats=False)
    clock.advance(100.0)
    sup.check()
    assert sup.state == "up" and not made[0].killed


def test_a_worker_never_ready_is_killed():
    sup, made, clock = make(SupervisorConfig(ready_s=10, backoff_s=1), ready=False)
    assert sup.state == "starting" and not sup.alive
    clock.advance(11)
    sup.check()
    assert made[0].killed and sup.state == "restarting"


def test_a_step_commits_go_to_the_worker_that_owns_each_session():
    sup, made, clock = make()
    old = sup.new_session()
    made[0].dead = True
    sup.check()
    clock.advance(1.1)
    sup.check()
    sup.check()
    new = sup.new_session()
    sup.send(Commits([Commit(old, [1], 0.1), Commit(new, [2], 0.1)]))
    (msg,) = made[1].sent
    assert [c.sid for c in msg.items] == [new], "the lost worker's session goes nowhere"


def test_config_is_checked():
    with pytest.raises(ValueError, match="hang_s"):
        SupervisorConfig(hang_s=0)
    with pytest.raises(ValueError, match="max_backoff_s"):
        SupervisorConfig(backoff_s=5, max_backoff_s=1)
