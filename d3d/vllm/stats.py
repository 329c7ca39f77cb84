"""The vLLM proposer's figures, readable from another process over a Unix socket.

The proposer lives in vLLM's model-runner process, out of the server's reach. When
``D3D_VLLM_STATS`` names a socket path, :class:`StatsServer` answers there from threads of that
process (no child process: vLLM's runner may not start one): ``["request", id]`` gives one
request's decode statistics (:class:`~d3d.decoding.stats.DecodeStats` as a dict, null if
unknown), ``["totals"]`` the branch statistics summed over every request so far and the drafter
worker's status. :class:`StatsClient` is the server's side.

Plain data only: each question and answer is one JSON value behind a 4-byte big-endian length
(at most :data:`MAX_FRAME` bytes), so bytes from the socket can build nothing but JSON values; a
frame that is not JSON gets ``{"error": ...}`` and the connection is closed. The socket lives in
a private folder (:mod:`d3d.worker.private`: the server's own ``mkdtemp`` folder, or one an
operator names, which must be owned by this user and closed to others), both ends refuse any
other, and the server answers only peers of its own user (``SO_PEERCRED``).

Every client call is time-bounded (``timeout``, default :data:`TIMEOUT_S`): a runner busy in a
long step or stopped answers None instead of holding the caller, and the connection is dropped
(a late answer must not be read as the next question's).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from d3d.worker import private

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20  # bytes of one question or answer
TIMEOUT_S = 2.0
MAX_CONNECTIONS = 8
_HEADER = struct.Struct("!I")


class FrameError(ValueError):
    """Bytes that are no frame of this protocol."""


def send_frame(sock: socket.socket, value: object) -> None:
    data = json.dumps(value, default=_plain, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise FrameError(f"a frame of {len(data)} bytes is over {MAX_FRAME}")
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> object:
    """One JSON value; EOFError when the peer closed, FrameError for what is not one."""
    (n,) = _HEADER.unpack(_read(sock, _HEADER.size))
    if n > MAX_FRAME:
        raise FrameError(f"a frame of {n} bytes is over {MAX_FRAME}")
    try:
        return json.loads(_read(sock, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"not JSON ({type(exc).__name__})") from None


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _plain(obj: object) -> object:
    """numpy scalars and tuples-like values as JSON values; anything else as its text."""
    item = getattr(obj, "item", None)
    return item() if callable(item) else str(obj)


class StatsServer:
    """Answers questions with ``answer(question)`` on a Unix socket at ``path``, whose folder
    must be private (:func:`d3d.worker.private.check`; NotPrivateError otherwise)."""

    def __init__(self, path: str, answer: Callable[[tuple], object]):
        self.path, self.answer = path, answer
        self.sock = private.listen(path, MAX_CONNECTIONS)
        self._answering = threading.Lock()  # one answer at a time, as the proposer expects
        self._open = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._accept, name="d3d-vllm-stats", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not private.peer_is_us(conn) or not self._open.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                while True:
                    try:
                        question = recv_frame(conn)
                    except FrameError as exc:  # refuse, and stop reading this peer
                        send_frame(conn, {"error": f"bad question: {exc}"})
                        return
                    send_frame(conn, self._reply(question))
        except (EOFError, OSError, struct.error):
            return
        finally:
            self._open.release()

    def _reply(self, question: object) -> object:
        if not isinstance(question, list) or not question or not isinstance(question[0], str):
            return {"error": "a question is a list that starts with its kind"}
        try:
            with self._answering:
                return self.answer(tuple(question))
        except Exception as exc:  # a bad question gets an error, not a crash
            return {"error": f"{type(exc).__name__}: {exc}"}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class StatsClient:
    """One connection to a :class:`StatsServer`, reopened when it breaks (thread-safe); every
    call gives up after ``timeout`` seconds (see the module docstring)."""

    def __init__(self, path: str, timeout: float = TIMEOUT_S):
        self.path, self.timeout = path, timeout
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False

    def ask(self, *question: object) -> object | None:
        """The answer to ``question``; None when nobody answers in time (or at all)."""
        if not self._lock.acquire(timeout=self.timeout):
            return None  # another call is waiting on a slow runner: do not queue behind it
        try:
            for _ in range(2):
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                        if self._conn is None:
                            return None
                    send_frame(self._conn, list(question))
                    return recv_frame(self._conn)
                except TimeoutError:
                    self._drop()
                    return None
                except (EOFError, OSError, ValueError, struct.error):
                    self._drop()
            return None
        finally:
            self._lock.release()

    def _connect(self) -> socket.socket | None:
        if not os.path.exists(self.path):
            return None
        try:
            return private.connect(self.path, self.timeout)
        except private.NotPrivateError as exc:
            if not self._warned:
                log.error("D3D stats: refusing %s (%s)", self.path, exc)
                self._warned = True
            return None

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class StatsPoller:
    """The latest ``["totals"]`` answer, asked every ``period`` seconds on a thread of its own,
    so that callers on an event loop (``/ready``, ``/metrics``) read a cached value and never
    wait on vLLM's runner. ``tick``: called after each poll (a health check of the caller's)."""

    def __init__(
        self, client: StatsClient, period: float = 1.0, tick: Callable[[], None] | None = None
    ):
        self.client, self.period, self.tick = client, period, tick
        self.totals: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="d3d-stats-poll", daemon=True)
            self._thread.start()

    def poll(self) -> dict | None:
        """Ask now (on the calling thread; bounded by the client's timeout)."""
        out = self.client.ask("totals")
        self.totals = out if isinstance(out, dict) and "error" not in out else None
        return self.totals

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.poll()
                if self.tick is not None:
                    self.tick()
            except Exception:  # a poll that failed leaves the last value; the next may work
                log.exception("D3D stats: polling failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.client.timeout + self.period)
