"""Stopping the service gracefully: admission closes, running requests finish, then everything
the service started is closed.

uvicorn's own SIGTERM handling closes the listening socket at once (new clients get a refused
connection) and gives open connections ``timeout_graceful_shutdown`` seconds before cancelling
them. The service wants more: a load balancer must see ``/ready`` turn 503 and new requests
answered 503 with ``Retry-After`` while the requests it already accepted run to their end. So:

- :class:`Admission`, an ASGI middleware, counts the HTTP requests in flight and, once
  :class:`Lifecycle` is draining, answers every new one with 503 and ``Retry-After`` (``/ready``
  says ``stopping``; ``/health`` and ``/metrics`` still answer);
- :class:`GracefulServer`, a ``uvicorn.Server``, turns the first SIGTERM (or SIGINT) into the
  start of the drain and, at uvicorn's tick, into uvicorn's own exit once nothing is in flight
  or ``drain_timeout`` seconds have passed; a second signal exits at once (uvicorn's way). Then
  uvicorn's shutdown runs as usual: connections get :data:`GRACE_S` more seconds (whatever is
  still running at the deadline is cut off there), and the app's lifespan shutdown closes the
  engine worker: its threads, the engine, the drafter worker process, vLLM and every temporary
  folder (:meth:`app.engines.own.EngineWorker.stop`, :meth:`app.engines.vllm.VllmWorker.stop`).
- A worker that cannot serve again (its engine thread gave up, vLLM's engine died) calls
  :meth:`GracefulServer.fatal`: the same drain and stop, and :func:`serve` returns 1 so that the
  process supervisor (systemd, Docker's restart policy, Kubernetes) starts a fresh one.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from types import FrameType

import uvicorn

log = logging.getLogger("app.lifecycle")

GRACE_S = 2.0  # after the drain, for responses still being written (uvicorn's graceful timeout)
ALWAYS = ("/health", "/metrics")  # answered while draining
RETRY_AFTER = "5"


class Lifecycle:
    """The drain's state, shared by the middleware, the server and the routes."""

    def __init__(self, drain_timeout: float):
        self.drain_timeout = drain_timeout
        self.inflight = 0  # HTTP requests being answered (the event loop's count: no lock)
        self.draining_since: float | None = None
        self.exit_code = 0

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def begin(self, why: str) -> None:
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            log.info(
                "%s: refusing new requests, %d in flight get up to %.0f s",
                why,
                self.inflight,
                self.drain_timeout,
            )

    def drained(self) -> bool:
        """Nothing in flight, or the deadline passed (what is left is then cut off)."""
        if self.draining_since is None:
            return False
        if self.inflight == 0:
            return True
        if time.monotonic() - self.draining_since >= self.drain_timeout:
            log.warning("drain deadline passed: cutting off %d request(s)", self.inflight)
            return True
        return False


class Admission:
    """ASGI middleware: count requests in flight; refuse new ones while draining."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining and scope["path"] not in ALWAYS:
            await _refuse(scope, send)
            return
        self.lifecycle.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.inflight -= 1


async def _refuse(scope, send) -> None:
    if scope["path"] == "/ready":
        body: dict = {"status": "stopping", "error": None}
    else:
        rid = (scope.get("state") or {}).get("request_id") or "-"
        message = "the server is stopping: retry later"
        err = {"message": message, "type": "server_busy", "param": None, "code": 503}
        body = {"error": err, "request_id": rid}
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"retry-after", RETRY_AFTER.encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining:  # a second signal: uvicorn's exit now
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
        self.lifecycle.begin(signal.Signals(sig).name)

    def fatal(self, why: str) -> None:
        """The worker cannot serve again: drain, stop, exit with status 1 (any thread)."""
        self.lifecycle.exit_code = 1
        self.lifecycle.begin(why)

    async def on_tick(self, counter: int) -> bool:
        if self.lifecycle.drained():
            self.should_exit = True
        return await super().on_tick(counter)


def serve(app, host: str, port: int, log_level: str = "info", **options: object) -> int:
    """Run ``app`` (:func:`app.main.create_app`'s) until a signal or a fatal worker error;
    the exit status. ``options``: more of ``uvicorn.Config``'s arguments."""
    lifecycle: Lifecycle = app.state.lifecycle
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACE_S,
        **options,  # type: ignore[arg-type]
    )
    server = GracefulServer(config, lifecycle)
    app.state.worker.on_fatal = server.fatal
    server.run()
    return lifecycle.exit_code
