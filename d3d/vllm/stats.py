"""The vLLM proposer's figures, readable from another process over a Unix socket.

The proposer lives in vLLM's model-runner process, out of the server's reach. When
``D3D_VLLM_STATS`` names a socket path, :class:`StatsServer` answers there from a thread of that
process (no child process: vLLM's runner may not start one): ``("request", id)`` gives one
request's decode statistics (:class:`~d3d.decoding.stats.DecodeStats` as a dict, None if
unknown), ``("totals",)`` the branch statistics summed over every request so far and the drafter
worker's status. :func:`ask` is the client's side (None when nobody answers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Listener

log = logging.getLogger(__name__)


class StatsServer:
    """Answers questions with ``answer(question)`` on a Unix socket at ``path``."""

    def __init__(self, path: str, answer: Callable[[tuple], object]):
        self.path, self.answer = path, answer
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.listener = Listener(path, family="AF_UNIX")
        self._thread = threading.Thread(target=self._serve, name="d3d-vllm-stats", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    while True:
                        question = conn.recv()
                        try:
                            reply = self.answer(tuple(question))
                        except Exception as exc:  # a bad question gets an error, not a crash
                            reply = {"error": f"{type(exc).__name__}: {exc}"}
                        conn.send(reply)
                except (EOFError, OSError):
                    continue

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class StatsClient:
    """One connection to a :class:`StatsServer`, reopened when it breaks (thread-safe)."""

    def __init__(self, path: str):
        self.path = path
        self._conn = None
        self._lock = threading.Lock()

    def ask(self, *question: object) -> object | None:
        with self._lock:
            for _ in range(2):
                try:
                    if self._conn is None:
                        if not os.path.exists(self.path):
                            return None
                        self._conn = Client(self.path, family="AF_UNIX")
                    self._conn.send(question)
                    return self._conn.recv()
                except (EOFError, OSError):
                    self._conn = None
            return None
