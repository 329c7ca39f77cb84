"""Where the drafter runs: a thread beside the target, or its own process on its own cores.

A worker runs a :class:`~d3d.worker.server.DraftServer` behind a message channel, and one
:class:`WorkerClient` on the target's side routes its replies to the requests waiting for them
(a reader thread files each reply under its session id), so one worker serves every request of
an engine. Two transports share that client:

- :class:`ThreadWorker` — the server in a thread of this process, fed by queues: tests, a
  drafter on its own GPU (``cuda:1``; torch releases the GIL while kernels run), single-core
  hosts.
- :class:`ProcessWorker` — the server in an OS process of its own (``python -m
  d3d.worker.child``, started with :mod:`subprocess` over a socket pair, so that a host that may
  not fork multiprocessing children, such as vLLM's model-runner daemon, can start it too),
  pinned to its own CPU cores with its own torch thread count (``cpu:1``) or on its own GPU. The
  child builds its drafter from a factory of plain fields (model specs, never tensors), only
  messages cross the socket, as msgpack tagged by type (:mod:`d3d.worker.codec`; never pickle:
  what the parent reads can build nothing but a reply), and a thread of the child sends a
  :class:`~d3d.worker.protocol.Beat` every ``beat_s`` whether the drafter is busy or not. Given a
  :class:`~d3d.worker.reading.ReaderSpec`, it also reads documents for the service
  (:mod:`d3d.worker.reading`), so that a drafter served beside vLLM exists once.

A worker that dies (its socket closes), stops beating, answers with something that is not a
message, or stops answering is the requests' problem only in that they lose speculation:
:class:`~d3d.worker.proposer.AsyncProposer` times out, counts the failure and finishes on the
target alone; :class:`~d3d.worker.supervisor.Supervisor` replaces the worker.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from d3d.worker.packed import PackedDraftServer
from d3d.worker.protocol import CODEC, Beat, Block, Failed, Ready, Stop
from d3d.worker.reading import ReaderSpec, ReadServer
from d3d.worker.server import DraftServer, MessageServer, ServerConfig

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 * 1024 * 1024  # bytes; a longer frame is no message (the reader gives up)


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


def server_for(drafter: Any, cfg: ServerConfig | None = None) -> MessageServer:
    """What a worker runs for ``drafter``: a :class:`DraftServer`, unless the drafter brings a
    server of its own (the replay instrument's, :mod:`d3d.replay`), which reads and answers the
    same messages, or the cuda backend readied it for packed drafting
    (:class:`~d3d.worker.packed.PackedDraftServer`) and its sample agrees
    (:mod:`d3d.worker.packed_check`)."""
    own = getattr(drafter, "server", None)
    if callable(own):
        return own(cfg)
    from d3d.worker.packed_check import proven_plan

    plan = proven_plan(drafter)
    if plan is not None:  # the cuda backend's packed drafting (d3d.worker.packed)
        return PackedDraftServer(drafter, cfg, plan=plan)
    return DraftServer(drafter, cfg)


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
        self.last_beat = time.monotonic()  # a worker that beats (a process) refreshes this
        self.why = ""  # why the worker is gone, once it is
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

    @property
    def pid(self) -> int | None:
        """The worker's process id (None: a thread of this process)."""
        return None

    @property
    def beats(self) -> bool:
        """Whether the worker sends heartbeats (so that silence means it hangs)."""
        return False

    def kill(self) -> None:
        """End the worker now, whatever it is doing (a thread cannot be killed: no-op)."""

    # ----- the reader thread ------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._recv()
            except (EOFError, OSError, ConnectionError):
                self.why = self.why or "its channel closed"
                break
            except Exception as exc:  # bytes that are no message: the worker cannot be trusted
                self.why = f"it sent something unreadable ({type(exc).__name__})"
                log.error("drafter worker: %s", self.why)
                break
            if isinstance(msg, Beat):
                self.last_beat = time.monotonic()
            elif isinstance(msg, Ready):
                self.info = dict(msg.info)
                self.last_beat = time.monotonic()
                self.ready.set()
            elif isinstance(msg, Stop):
                self.why = self.why or "it stopped"
                break
            elif isinstance(msg, Failed) and msg.sid is None:
                self.why = f"it failed: {msg.message}"
                log.error("drafter worker failed: %s", msg.message)
                break
            elif isinstance(msg, (Block, Failed)):
                box = self._boxes.get(msg.sid)
                if box is not None:  # replies to ended sessions are dropped
                    box.put(msg)
            else:
                self.why = f"it sent a {type(msg).__name__}, which is no reply"
                log.error("drafter worker: %s", self.why)
                break
        self.dead = True
        self.kill()
        self.ready.set()
        for box in list(self._boxes.values()):
            box.put(None)


def serve(
    server: MessageServer,
    get: Callable[[], object],
    put: Callable[[object], None],
    pending: Callable[[], bool] | None = None,
) -> None:
    """The worker loop: each message's replies go out as soon as they exist; ``pending()``: the
    next message is waiting already (the server then prepares no branches)."""
    if pending is not None:
        server.pending = pending
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
        self.server = server_for(drafter, cfg)
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
            serve(self.server, self._inbox.get, self._outbox.put, lambda: not self._inbox.empty())

    def close(self) -> None:
        if not self.dead:
            self._inbox.put(Stop())
            self._thread.join(timeout=10)


@dataclass(frozen=True)
class ChildStart:
    """The first message to a worker process: how to build and run its drafter."""

    factory: Callable[[], object]
    cores: list[int] | None
    threads: int | None
    cfg: ServerConfig | None
    beat_s: float
    nice: int
    reader: ReaderSpec | None = None  # documents read here for the service (d3d.worker.reading)


def child_main(conn: Connection, start: ChildStart) -> None:
    """The worker process: pin, build the drafter, beat, serve until Stop (see
    :mod:`d3d.worker.child`)."""
    lock = threading.Lock()

    def put(msg: object) -> None:
        with lock:
            send(conn, msg)

    try:
        pin_process(start.cores, start.threads)
        # The drafter only ever takes what the target leaves: while speculation is off the target
        # may use every core, and a catch-up encode here must not slow its steps.
        if start.nice:
            os.nice(start.nice)
        drafter = start.factory()
        server = server_for(drafter, start.cfg)
        info = {
            "kind": "process",
            "pid": os.getpid(),
            "cores": start.cores,
            "threads": torch.get_num_threads(),
            "device": str(getattr(drafter, "device", "cpu")),
            "layers": len(getattr(getattr(drafter, "meta", None), "layers", ()) or ()),
        }
        if start.reader is not None:  # its socket is there before the parent hears Ready
            ReadServer(start.reader, drafter, info["device"])
        put(Ready(info))
        threading.Thread(target=_beat, args=(put, start.beat_s), daemon=True).start()
        serve(server, lambda: recv(conn), put, conn.poll)
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    except ValueError as exc:  # a message that is none: the parent cannot be understood
        log.error("drafter worker: %s", exc)
    except Exception as exc:  # reported once; the parent goes on without speculation
        with contextlib.suppress(OSError):
            put(Failed(None, f"{type(exc).__name__}: {exc}"))


def send(conn: Connection, msg: object, start: bool = False) -> None:
    """Write one message to ``conn`` (:data:`~d3d.worker.protocol.CODEC`'s bytes)."""
    conn.send_bytes(CODEC.encode(msg, start=start))


def recv(conn: Connection, start: bool = False) -> object:
    """Read one message from ``conn``; ValueError for bytes that are none (never unpickled)."""
    return CODEC.decode(conn.recv_bytes(MAX_MESSAGE), start=start)


def _beat(put: Callable[[object], None], every: float) -> None:
    with contextlib.suppress(OSError, ValueError):
        while True:
            time.sleep(every)
            put(Beat())


class ProcessWorker(WorkerClient):
    """The drafter server in its own process (see the module docstring). ``factory`` builds the
    drafter there; ``cores``: the CPU cores it is pinned to (None: wherever the OS puts it)."""

    def __init__(
        self,
        factory: Callable[[], object],
        cores: list[int] | None,
        threads: int | None = None,
        cfg: ServerConfig | None = None,
        beat_s: float = 0.5,
        nice: int = 10,
        reader: ReaderSpec | None = None,
    ):
        """``reader``: the worker also reads documents for the service (:mod:`d3d.worker.reading`)."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child imports what this process imports (a test's checkout, vLLM's workers).
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, env.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "d3d.worker.child", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        start = ChildStart(factory, cores, threads, cfg, beat_s, nice, reader)
        send(self._conn, start, start=True)
        super().__init__(lambda m: send(self._conn, m), lambda: recv(self._conn))

    @property
    def alive(self) -> bool:
        return not self.dead and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def beats(self) -> bool:
        return True

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.kill()

    def close(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ConnectionError, OSError):
                self.send(Stop())
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.dead = True
        with contextlib.suppress(OSError):
            self._conn.close()


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()
