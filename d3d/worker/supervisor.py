"""A drafter worker that heals itself: watched, replaced when it dies or hangs, visible.

:class:`Supervisor` owns the worker of one engine (the own engine's, or the vLLM proposer's) and
is the :class:`~d3d.worker.proposer.WorkerLink` every request's proposer talks through. A watch
thread looks at the worker every ``poll_s``:

- **dead** (its process exited, its channel closed, it sent something that is no message, or it
  reported a failure): replaced after a backoff that starts at ``backoff_s`` and doubles up to
  ``max_backoff_s`` (reset once a worker has stayed up for ``stable_s``);
- **hung** (a worker that beats, i.e. a process, sent no heartbeat for ``hang_s``; a stopped
  process sends none, a busy one still does from its heartbeat thread): killed, then replaced
  the same way;
- **not ready** within ``ready_s`` of its start: killed and replaced.

Sessions belong to the worker that opened them. When a worker goes, every request waiting on
it wakes at once (its channel's reader wakes their boxes) and finishes on the target alone;
messages for its sessions go nowhere (``send`` raises ``ConnectionError``, which the proposer
counts as a failure). Requests that start while no worker is up take plain steps
(:attr:`alive` is False), and speculation resumes with the first request after the replacement is
ready. Nothing is shared between workers: a new worker's sessions are rebuilt from token ids
by the proposers that open them.

:meth:`status` is what ``/ready`` shows (``state``: ``up``, ``starting``, ``restarting``,
``down``; ``pid``; ``restarts``), and what ``/metrics`` turns into
``d3d_drafter_worker_up`` and ``d3d_drafter_worker_restarts_total``; every change is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from d3d.worker.protocol import Commits
from d3d.worker.workers import WorkerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisorConfig:
    """How the watch thread judges a worker (see the module docstring); seconds."""

    poll_s: float = 0.2
    hang_s: float = 5.0
    ready_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("poll_s", "hang_s", "ready_s", "backoff_s", "max_backoff_s", "stable_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError("max_backoff_s must be >= backoff_s")


class Supervisor:
    """Starts, watches and replaces one drafter worker (see the module docstring).

    ``start()`` makes a new worker (a :class:`~d3d.worker.workers.WorkerClient`); it is called
    on the watch thread, never on a request's path. ``clock``: monotonic seconds (tests pass a
    fake one and call :meth:`check` themselves with ``watch=False``).
    """

    def __init__(
        self,
        start: Callable[[], WorkerClient | None],
        cfg: SupervisorConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        watch: bool = True,
    ):
        self._start = start
        self.cfg = cfg or SupervisorConfig()
        self.clock = clock
        self.restarts = 0
        self.state = "starting"
        self.last_error = ""
        self._lock = threading.RLock()
        self._owner: dict[int, WorkerClient] = {}
        self._stop = threading.Event()
        self._backoff = self.cfg.backoff_s
        self._next_start: float | None = None
        self._up_since: float | None = None
        self._worker: WorkerClient | None = None
        self._started_at = clock()
        self._ready = threading.Event()
        self._launch()
        self._thread = None
        if watch:
            self._thread = threading.Thread(target=self._watch, name="d3d-supervisor", daemon=True)
            self._thread.start()

    # ----- what proposers use (WorkerLink) ----------------------------------------------------
    @property
    def worker(self) -> WorkerClient | None:
        return self._worker

    @property
    def alive(self) -> bool:
        w = self._worker
        return self.state == "up" and w is not None and w.alive

    def new_session(self) -> int:
        with self._lock:
            w = self._worker
            if w is None or not w.alive:
                raise ConnectionError("no drafter worker is up")
            sid = w.new_session()
            self._owner[sid] = w
            return sid

    def end_session(self, sid: int) -> None:
        with self._lock:
            w = self._owner.pop(sid, None)
        if w is not None:
            w.end_session(sid)

    def send(self, msg: object) -> None:
        if isinstance(msg, Commits):  # a step's commits may span workers (one was replaced)
            by_worker: dict[int, tuple[WorkerClient, list]] = {}
            for item in msg.items:
                w = self._owner.get(item.sid)
                if w is not None and w.alive:
                    by_worker.setdefault(id(w), (w, []))[1].append(item)
            for w, items in by_worker.values():
                w.send(Commits(items))
            return
        w = self._owner.get(getattr(msg, "sid", -1))
        if w is None or not w.alive:
            raise ConnectionError("the drafter worker that served this request is gone")
        w.send(msg)

    def recv(self, sid: int, timeout: float) -> object | None:
        w = self._owner.get(sid)
        return None if w is None else w.recv(sid, timeout)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until a worker is up (False after ``timeout`` seconds or once closed)."""
        end = time.monotonic() + timeout
        while not self._stop.is_set():
            if self.alive:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._ready.wait(min(left, 0.1))
        return False

    @property
    def info(self) -> dict:
        w = self._worker
        return dict(w.info) if w is not None else {}

    def status(self) -> dict:
        """``{"state", "pid", "restarts"}`` (and the last error, once there was one)."""
        w = self._worker
        out = {
            "state": self.state,
            "pid": w.pid if w is not None and self.state != "down" else None,
            "restarts": self.restarts,
        }
        if self.last_error:
            out["last_error"] = self.last_error
        return out

    # ----- watching ---------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            try:
                self.check()
            except Exception:  # the watch thread must outlive anything one check runs into
                log.exception("drafter worker supervision failed")

    def check(self) -> None:
        """One look at the worker: mark it up, replace it, or start the replacement that is due."""
        now = self.clock()
        with self._lock:
            w = self._worker
            if w is None:
                if self._next_start is not None and now >= self._next_start:
                    self._launch()
                return
            if w.dead or not w.alive:
                self._lost(w, w.why or "its process exited")
            elif not w.ready.is_set():
                if now - self._started_at > self.cfg.ready_s:
                    self._lost(w, f"it was not ready within {self.cfg.ready_s:.0f} s", kill=True)
            elif w.beats and now - w.last_beat > self.cfg.hang_s:
                self._lost(w, f"it sent no heartbeat for {now - w.last_beat:.1f} s", kill=True)
            else:
                if self.state != "up":
                    log.info("drafter worker up (pid %s, restarts %d)", w.pid, self.restarts)
                    self.state, self._up_since = "up", now
                    self._ready.set()
                elif self._up_since is not None and now - self._up_since > self.cfg.stable_s:
                    self._backoff = self.cfg.backoff_s

    def _lost(self, w: WorkerClient, why: str, kill: bool = False) -> None:
        """The worker is gone or useless: end it and schedule the replacement."""
        self.last_error = why
        log.warning(
            "drafter worker (pid %s) lost: %s; requests in flight finish on the target alone; "
            "a new worker starts in %.1f s",
            w.pid,
            why,
            self._backoff,
        )
        if kill:
            w.kill()
        w.dead = True
        for box in list(w._boxes.values()):  # wake every request waiting on it
            box.put(None)
        self._worker, self.state, self._up_since = None, "restarting", None
        self._ready.clear()
        self._owner = {sid: o for sid, o in self._owner.items() if o is not w}
        self._next_start = self.clock() + self._backoff
        self._backoff = min(self._backoff * 2, self.cfg.max_backoff_s)
        threading.Thread(target=_close_quietly, args=(w,), daemon=True).start()

    def _launch(self) -> None:
        first = self._next_start is None
        self._next_start = None
        try:
            w = self._start()
        except Exception as exc:
            w, self.last_error = None, f"{type(exc).__name__}: {exc}"
            log.exception("starting the drafter worker failed")
        if w is None:
            self.state = "down"
            self._next_start = self.clock() + self._backoff
            self._backoff = min(self._backoff * 2, self.cfg.max_backoff_s)
            return
        if not first:
            self.restarts += 1
            log.info("drafter worker restarted (pid %s, restart %d)", w.pid, self.restarts)
        self._worker, self._started_at = w, self.clock()
        self.state = "starting" if first else "restarting"

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            w, self._worker = self._worker, None
            self.state = "down"
        if w is not None:
            w.close()


def _close_quietly(w: WorkerClient) -> None:
    try:
        w.close()
    except Exception:
        log.debug("closing a lost drafter worker failed", exc_info=True)
