"""The async side of a job: wait for its prompt, then its tokens, within a deadline.

Routes submit a :class:`~app.engines.own.Job` and consume it through these helpers, which turn the
worker's events into text (with stop strings), enforce the per-request timeout (504 before the
answer starts), and cancel the job whenever the consumer goes away (client disconnect, timeout,
a stop string): the engine then drops the rows before their next round. A prompt that only
tokenises (a chat, a completion) is built here on the thread pool before the job is submitted,
so the engine thread never tokenises while rows wait on its step.

A job has ``n`` rows (choices). :meth:`Run.deltas` yields a :class:`Delta` per choice and event:
its first tokens (``first``, even when their text is still held back, so a stream's first
chunk leaves with the first token), later text and log-probabilities, and its end
(``finish``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from app.engines import ServingEngine
from app.engines.jobs import (
    Event,
    Finished,
    Job,
    JobFailed,
    Models,
    PromptReady,
    Tokens,
    admit,
    build_prompt,
)
from app.errors import ApiError
from app.prepared import Prepared, PromptBuilder
from app.text import TextStream
from d3d.sampling import TokenLogprob


@dataclass
class Choice:
    """One row's answer: its text, why it ended, its decode statistics, its logprobs."""

    index: int
    text: str = ""
    finish_reason: str = "length"
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Outcome:
    """A finished generation as the routes report it (``text``, ``finish_reason`` and ``stats``
    are the first choice's)."""

    choices: list[Choice] = field(default_factory=lambda: [Choice(0)])
    prepared: Prepared | None = None
    queue_s: float = 0.0
    total_s: float = 0.0

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def stats(self) -> dict:
        return self.choices[0].stats

    @property
    def completion_tokens(self) -> int:
        return sum(int(c.stats.get("num_tokens", 0)) for c in self.choices)


@dataclass
class Delta:
    """What one event adds to choice ``index``: text safe to send, the logprobs of the tokens
    it carries, whether they are the choice's first, and its finish reason once it ended."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first: bool = False
    finish: str | None = None


class Run:
    """One submitted job with its deadline (see the module docstring)."""

    def __init__(self, worker: ServingEngine, job: Job, stop=(), timeout: float = 300.0, hidden=()):
        """``stop``: stop strings; ``hidden``: ids kept out of the text (``stop_token_ids``)."""
        self.worker, self.job = worker, job
        self.deadline = time.perf_counter() + timeout
        self.stop, self.hidden = stop, hidden
        self.texts: list[TextStream] = []  # a choice's text, made once its prompt is ready
        self.outcome = Outcome([Choice(i) for i in range(job.n)])
        self.started: set[int] = set()  # the choices whose first tokens came

    async def _next(self):
        left = self.deadline - time.perf_counter()
        try:
            return await asyncio.wait_for(self.job.events.get(), timeout=max(left, 0.001))
        except TimeoutError:
            self.job.cancel()
            raise ApiError(504, "the request timed out", kind="timeout") from None

    async def start(self) -> Prepared:
        """Submit and wait until the prompt is built and queued (errors raise ApiError)."""
        if not self.job.reads_document:
            await self._tokenise()
        self.worker.submit(self.job)
        event = await self._next()
        if not isinstance(event, PromptReady):
            raise _answer(event)
        self.outcome.prepared = event.prepared
        self.outcome.queue_s = self.job.dequeued - self.job.submitted
        detok = self.worker.detokenizer
        self.texts = [TextStream(detok, self.stop, self.hidden) for _ in range(self.job.n)]
        return event.prepared

    async def _tokenise(self) -> None:
        """Build a prompt that only tokenises here, on a thread of the pool: a long chat's
        tokenising then holds up neither the event loop nor the engine thread (which every
        decoding row waits on). The worker gets the prompt ready-made."""
        admit(self.worker)  # 503 at once: no tokenising for a request that cannot queue
        models = self.worker.models
        prepared = await run_in_threadpool(_locked_build, self.job, models)
        if prepared is None:  # build_prompt queued the error
            raise _answer(await self._next())
        self.job.prepare = PromptBuilder(lambda _models: prepared)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's deltas as they become safe to send; ``outcome`` is complete when
        this ends."""
        left = set(range(self.job.n))
        try:
            while left:
                event = await self._next()
                if isinstance(event, Tokens):
                    if (delta := self._tokens(event.row, event.ids, event.logprobs)) is not None:
                        yield delta
                elif isinstance(event, Finished):
                    yield self._done(event.row, event.stats)
                    left.discard(event.row)
                else:
                    raise _answer(event)
        finally:
            self.job.cancel()  # no-op when finished; stops the rows when the consumer left early
            for choice, text in zip(self.outcome.choices, self.texts, strict=True):
                choice.text = text.text
            self.outcome.total_s = time.perf_counter() - self.job.submitted

    def _tokens(self, i: int, ids: list[int], logprobs) -> Delta | None:
        text, choice = self.texts[i], self.outcome.choices[i]
        if text.stopped:
            return None
        delta = Delta(i, text.push(ids), list(logprobs or []), first=i not in self.started)
        self.started.add(i)
        choice.logprobs += delta.logprobs
        if text.stopped:  # a stop string: this choice ends here (the others go on)
            choice.finish_reason = "stop"
            if self.job.n == 1:
                self.job.cancel()
            else:
                self.job.reqs[i].cancel()
        return delta

    def _done(self, i: int, stats: dict) -> Delta:
        text, choice = self.texts[i], self.outcome.choices[i]
        choice.stats = stats
        tail = ""
        if not text.stopped:
            tail = text.flush()
            choice.finish_reason = "stop" if stats.get("stop_reason") == "eos" else "length"
        return Delta(i, tail, finish=choice.finish_reason)

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


def _locked_build(job: Job, models: Models) -> Prepared | None:
    """The job's prompt, one at a time: the engine's tokenizer is not re-entrant (a fast
    tokenizer refuses a second caller while one encodes)."""
    with models.prompt_lock:
        return build_prompt(job, models)


def _answer(event: Event) -> ApiError:
    """The client's answer to an event that ends a job early: its error when that is one for
    the client, else "internal error" (the text stays in the log)."""
    error = event.error if isinstance(event, JobFailed) else None
    if isinstance(error, ApiError):
        return error
    return ApiError(500, "internal error", kind="server_error")
