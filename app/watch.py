"""What the engine worker does when one of its threads fails.

The engine thread steps the scheduler, whose own guard fails a batch whose forward raised; what
can still escape is a failure around it (taking jobs, building prompts, admitting rows). Such a
failure must not leave the service looking ready while every request waits for its timeout:

- the engine loop *restarts*, as the drafter worker's supervisor restarts a worker
  (:mod:`d3d.worker.supervisor`): ``/ready`` says ``restarting`` (503), every request the worker
  holds is answered 503 at once and cancelled (:func:`fail_jobs`; its rows leave at the next
  step, their KV with them), and after a backoff (:class:`Restarts`: 1 s, doubling to 30 s,
  reset once the loop has run a minute without failing) the loop serves again;
- a failure that keeps coming back (:attr:`Restarts.limit` restarts without a quiet minute), or
  a thread that ends for any reason before the worker is stopped (:func:`watched`), fails the
  worker for good: ``/ready`` says ``failed``, waiting requests get 503, and the worker's
  ``on_fatal`` hook (:mod:`app.lifecycle`) drains and stops the process with status 1, so its
  supervisor (systemd, Docker, Kubernetes) starts a fresh one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from app.engines.jobs import JobFailed
from app.errors import ApiError

log = logging.getLogger("app.engines.own")


def fail_jobs(jobs: Iterable, why: str) -> None:
    """Answer each job with 503 (``Retry-After``) and cancel it (any thread)."""
    for job in jobs:
        if job.cancelled:
            continue
        job.put(JobFailed(ApiError(503, why, kind="server_error", headers={"Retry-After": "5"})))
        job.cancel()


class Restarts:
    """Backoff between restarts of a loop (see the module docstring)."""

    def __init__(
        self, backoff_s: float = 1.0, max_backoff_s: float = 30.0, stable_s: float = 60.0,
        limit: int = 5,
    ):  # fmt: skip
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.limit = limit
        self.count = 0  # restarts so far
        self._streak = 0  # restarts since the loop last ran stable_s without failing
        self._last = 0.0

    def next_delay(self) -> float | None:
        """Seconds to wait before the next restart; None: give up."""
        now = time.monotonic()
        if now - self._last >= self.stable_s:
            self._streak = 0
        self._last = now
        if self._streak >= self.limit:
            return None
        delay = min(self.backoff_s * 2**self._streak, self.max_backoff_s)
        self._streak += 1
        self.count += 1
        return delay


def watched(
    target: Callable[[], None], stopping: Callable[[], bool], fatal: Callable[[str], None]
) -> Callable[[], None]:
    """``target`` for a thread: if it ends before ``stopping()`` (returned or raised),
    ``fatal(why)``."""

    def run() -> None:
        name = threading.current_thread().name
        why = f"the {name} thread ended"
        try:
            target()
        except BaseException as exc:
            log.exception("the %s thread died", name)
            why = f"the {name} thread died: {type(exc).__name__}: {exc}"
        finally:
            if not stopping():
                fatal(why)

    return run
