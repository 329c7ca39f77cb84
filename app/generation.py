"""The async side of a job: wait for its prompt, then its tokens, within a deadline.

Routes submit a :class:`~app.worker.Job` and consume it through these helpers, which turn the
worker's events into text (with stop strings), enforce the per-request timeout (504 before the
answer starts), and cancel the job whenever the consumer goes away (client disconnect, timeout,
a stop string): the engine then drops the row before its next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from app.errors import ApiError
from app.text import TextStream
from app.worker import EngineWorker, Job, Prepared


@dataclass
class Outcome:
    """A finished generation as the routes report it."""

    text: str = ""
    finish_reason: str = "length"
    stats: dict = field(default_factory=dict)
    prepared: Prepared | None = None
    queue_s: float = 0.0
    total_s: float = 0.0


class Run:
    """One submitted job with its deadline (see the module docstring)."""

    def __init__(self, worker: EngineWorker, job: Job, stop=(), timeout: float = 300.0):
        self.worker, self.job = worker, job
        self.deadline = time.perf_counter() + timeout
        self.text = TextStream(worker.detokenizer, stop)
        self.outcome = Outcome()
        self._done = False

    async def _next(self):
        left = self.deadline - time.perf_counter()
        try:
            return await asyncio.wait_for(self.job.events.get(), timeout=max(left, 0.001))
        except TimeoutError:
            self.job.cancel()
            raise ApiError(504, "the request timed out", kind="timeout") from None

    async def start(self) -> Prepared:
        """Submit and wait until the prompt is built and queued (errors raise ApiError)."""
        self.worker.submit(self.job)
        kind, payload = await self._next()
        if kind == "error":
            raise payload if isinstance(payload, ApiError) else ApiError(500, "internal error")
        self.outcome.prepared = payload
        self.outcome.queue_s = self.job.dequeued - self.job.submitted
        return payload

    async def deltas(self) -> AsyncIterator[str]:
        """Text as it becomes safe to send; ``outcome`` is complete when this ends."""
        try:
            while True:
                kind, payload = await self._next()
                if kind == "tokens":
                    delta = self.text.push(payload)
                    if delta:
                        yield delta
                    if self.text.stopped:
                        self.job.cancel()
                        self.outcome.finish_reason = "stop"
                elif kind == "done":
                    self.outcome.stats = payload
                    if not self.text.stopped:
                        tail = self.text.flush()
                        if tail:
                            yield tail
                        reason = payload.get("stop_reason")
                        self.outcome.finish_reason = "stop" if reason == "eos" else "length"
                    break
                else:
                    raise (
                        payload
                        if isinstance(payload, ApiError)
                        else ApiError(500, "internal error", kind="server_error")
                    )
        finally:
            self.job.cancel()  # no-op when finished; stops the row when the consumer left early
            self.outcome.text = self.text.text
            self.outcome.total_s = time.perf_counter() - self.job.submitted

    async def collect(self, request: Request | None = None) -> Outcome:
        """Run to the end (non-streaming), cancelling if the client disconnects meanwhile."""
        watcher = asyncio.create_task(self._watch(request)) if request is not None else None
        try:
            async for _ in self.deltas():
                pass
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        return self.outcome

    async def _watch(self, request: Request) -> None:
        while True:
            if await request.is_disconnected():
                self.job.cancel()
                return
            await asyncio.sleep(0.25)
