"""Where the drafter runs: a thread beside the target, or its own process on its own cores.

A worker runs a :class:`~d3d.worker.server.DraftServer` behind a message channel, and one
:class:`WorkerClient` on the target's side routes its replies to the requests waiting for them
(a reader thread files each reply under its session id), so one worker serves every request of
an engine. Two transports share that client:

- :class:`ThreadWorker` — the server in a thread of this process, fed by queues: tests, a
  drafter on its own GPU (``cuda:1``; torch releases the GIL while kernels run), single-core
  hosts.
- :class:`ProcessWorker` — the server in a spawned OS process pinned to its own CPU cores with
  its own torch thread count (``cpu:1``), the target's process pinned to the others. The child
  builds its drafter from a picklable factory (model specs, never tensors), and only messages
  cross the pipe.

A worker that dies (its pipe closes) or stops answering is the requests' problem only in that
they lose speculation: :class:`~d3d.worker.proposer.AsyncProposer` times out, counts the
failure and finishes on the target alone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from d3d.worker.protocol import Failed, Ready, Stop
from d3d.worker.server import DraftServer, ServerConfig

log = logging.getLogger(__name__)


def pin_process(
    cores: list[int] | None,
    threads: int | None = None,
    skip: frozenset[int] | set[int] = frozenset(),
) -> None:
    """Pin every thread of this process but those in ``skip`` (native ids) to ``cores`` and
    size torch's pool to match.

    (Linux affinity is per thread; threads started later inherit it.) None leaves affinity
    alone and only sets the thread count when given.
    """
    if cores:
        cpus = set(cores)
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in (t for t in tids if t not in skip):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)
    n = threads or (len(cores) if cores else None)
    if n:
        torch.set_num_threads(n)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


class WorkerClient:
    """The target side of a worker: send messages, receive replies per session."""

    def __init__(self, send: Callable[[object], None], recv: Callable[[], object]):
        self._send, self._recv = send, recv
        self._send_lock = threading.Lock()
        self._boxes: dict[int, queue.Queue] = {}
        self._ids = itertools.count(1)
        self.ready = threading.Event()
        self.info: dict = {}
        self.dead = False
        self.failures = 0
        self._reader = threading.Thread(target=self._read, name="d3d-worker-reader", daemon=True)
        self._reader.start()

    # ----- sessions ---------------------------------------------------------------------
    def new_session(self) -> int:
        sid = next(self._ids)
        self._boxes[sid] = queue.Queue()
        return sid

    def end_session(self, sid: int) -> None:
        self._boxes.pop(sid, None)

    def send(self, msg: object) -> None:
        if self.dead:
            raise ConnectionError("the drafter worker is gone")
        with self._send_lock:
            self._send(msg)

    def recv(self, sid: int, timeout: float) -> object | None:
        """The next reply for session ``sid``, or None after ``timeout`` seconds."""
        box = self._boxes.get(sid)
        if box is None:
            return None
        try:
            return box.get(timeout=timeout)
        except queue.Empty:
            return None

    @property
    def alive(self) -> bool:
        return not self.dead

    def wait_ready(self, timeout: float) -> bool:
        return self.ready.wait(timeout) and not self.dead

    # ----- the reader thread ------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._recv()
            except (EOFError, OSError, ConnectionError):
                break
            if isinstance(msg, Ready):
                self.info = dict(msg.info)
                self.ready.set()
            elif isinstance(msg, Stop):
                break
            elif isinstance(msg, Failed) and msg.sid is None:
                log.error("drafter worker failed: %s", msg.message)
                break
            else:
                box = self._boxes.get(getattr(msg, "sid", -1))
                if box is not None:  # replies to ended sessions are dropped
                    box.put(msg)
        self.dead = True
        self.ready.set()
        for box in list(self._boxes.values()):
            box.put(None)


def serve(server: DraftServer, get: Callable[[], object], put: Callable[[object], None]) -> None:
    """The worker loop: each message's replies go out as soon as they exist."""
    while True:
        msg = get()
        if isinstance(msg, Stop):
            put(Stop())
            return
        for reply in server.handle(msg):
            put(reply)


class ThreadWorker(WorkerClient):
    """The drafter server in a thread of this process (see the module docstring)."""

    def __init__(self, drafter, cfg: ServerConfig | None = None):
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        super().__init__(self._inbox.put, self._outbox.get)
        self.server = DraftServer(drafter, cfg)
        self._thread = threading.Thread(target=self._run, name="d3d-drafter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            device = str(self.server.drafter.device)
        except Exception as exc:  # reported once; the engine goes on without speculation
            self._outbox.put(Failed(None, f"{type(exc).__name__}: {exc}"))
            return
        self._outbox.put(Ready({"kind": "thread", "device": device}))
        # A drafter on a GPU drafts on a stream of its own: on the target's GPU its kernels
        # then run beside the target's instead of queueing behind them.
        dev = torch.device(device)
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            serve(self.server, self._inbox.get, self._outbox.put)

    def close(self) -> None:
        if not self.dead:
            self._inbox.put(Stop())
            self._thread.join(timeout=10)


def _process_main(conn, factory, cores, threads, cfg) -> None:
    """Entry point of the drafter process: pin, build the drafter, serve until Stop."""
    try:
        pin_process(cores, threads)
        # The drafter only ever takes what the target leaves: while speculation is off the target
        # may use every core, and a catch-up encode here must not slow its steps.
        os.nice(10)
        drafter = factory()
        server = DraftServer(drafter, cfg)
        info = {
            "kind": "process",
            "pid": os.getpid(),
            "cores": cores,
            "threads": torch.get_num_threads(),
            "layers": len(getattr(drafter.meta, "layers", ())),
        }
        conn.send(Ready(info))
        serve(server, conn.recv, conn.send)
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception as exc:  # reported once; the parent goes on without speculation
        with contextlib.suppress(OSError):
            conn.send(Failed(None, f"{type(exc).__name__}: {exc}"))


class ProcessWorker(WorkerClient):
    """The drafter server in its own process, pinned to ``cores`` (see the module docstring)."""

    def __init__(
        self,
        factory: Callable[[], object],
        cores: list[int] | None,
        threads: int | None = None,
        cfg: ServerConfig | None = None,
    ):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # a fork would copy the parent's torch thread pools
        parent, child = ctx.Pipe()
        self._conn = parent
        self.process = ctx.Process(
            target=_process_main,
            args=(child, factory, cores, threads, cfg),
            name="d3d-drafter",
            daemon=True,
        )
        self.process.start()
        child.close()
        super().__init__(parent.send, parent.recv)

    @property
    def alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            with contextlib.suppress(ConnectionError, OSError):
                self.send(Stop())
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
        self.dead = True


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()
