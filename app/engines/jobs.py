"""A request's generation as the engine worker sees it, and what its prompt builder may use.

:class:`Job` is one request seen from both threads: the route builds it on the event loop,
the engine worker (either engine's) takes it, and typed events flow back worker -> event loop
through its asyncio queue (``call_soon_threadsafe``): :class:`PromptReady`, then per row
:class:`Tokens` and one :class:`Finished`, or a :class:`JobFailed`. :class:`Models` holds what a job's prompt builder
may use; :func:`build_prompt` runs the builder and tells the client why it failed, if it did.
:func:`admit` and :func:`check_mode` refuse a job before it is queued, for either engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.errors import ApiError
from app.prepared import Prepared
from d3d.config import SamplingConfig
from d3d.model.specs import refusal

if TYPE_CHECKING:
    from d3d.engine import GenRequest

log = logging.getLogger("app.engines.own")


class Models:
    """What a job's prompt builder may use: ``engine`` (the own engine, or beside vLLM the
    target's :class:`~d3d.model.load.TargetText`: a tokenizer and ``encode``), and the document
    reader that ``documents`` builds on first use (then shared by every request)."""

    def __init__(self, engine, documents: Callable[[], object]):
        self.engine = engine
        self._make_documents = documents
        self._documents = None
        self._lock = threading.Lock()
        self.prompt_lock = threading.Lock()  # the engine's tokenizer: one prompt at a time

    @property
    def documents(self):
        with self._lock:
            if self._documents is None:
                self._documents = self._make_documents()
            return self._documents


@dataclass(frozen=True)
class PromptReady:
    """The job's prompt is built and its rows are queued."""

    prepared: Prepared


@dataclass(frozen=True)
class Tokens:
    """Row ``row``'s next tokens (and their log-probabilities, when asked for)."""

    row: int
    ids: list[int]
    logprobs: list | None = None


@dataclass(frozen=True)
class Finished:
    """Row ``row`` ended; ``stats``: its decode statistics."""

    row: int
    stats: dict


@dataclass(frozen=True)
class JobFailed:
    """The job failed: ``error`` is the client's answer (an :class:`ApiError`) or an internal
    error (answered "internal error")."""

    error: BaseException


Event = PromptReady | Tokens | Finished | JobFailed


class Job:
    """One request's generation, seen from both threads (events flow worker -> event loop)."""

    def __init__(
        self,
        prepare: Callable[[Models], Prepared],
        max_new_tokens: int,
        sampling: SamplingConfig,
        mode: str,
        n: int = 1,
        logprobs: int | None = None,
    ):
        """``n`` rows of the prompt; ``logprobs``: each token's log-probability and that many
        alternatives (None: none)."""
        self.prepare, self.max_new_tokens, self.sampling, self.mode = (
            prepare,
            max_new_tokens,
            sampling,
            mode,
        )
        self.n, self.logprobs = n, logprobs
        self.reads_document = bool(getattr(prepare, "reads_document", False))
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.dequeued = 0.0  # the worker took it (queue time ends, prompt building starts)
        self.admitted = 0.0  # its prompt joined the engine's waiting list
        self.reqs: list[GenRequest] = []
        self.first = False
        self._cancelled = threading.Event()

    def put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self._cancelled.set()
        for req in self.reqs:
            req.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def build_prompt(job: Job, models: Models) -> Prepared | None:
    """The job's prompt, or None after telling the client why not (or it left)."""
    if job.cancelled:
        return None
    try:
        return job.prepare(models)
    except ApiError as exc:
        job.put(JobFailed(exc))
    except ValueError as exc:
        job.put(JobFailed(ApiError(400, str(exc))))
    except Exception as exc:
        log.exception("preparing a request failed")
        job.put(JobFailed(exc))
    return None


def check_mode(worker, mode: str) -> None:
    """Refuse with 400 a mode that needs the drafter where speculation is off (the reason
    ``/ready`` gives: no trained drafter for this target, or ``--drafter none``)."""
    info = worker.model_info
    why = refusal(mode, info.get("speculation") != "off", info.get("speculation_reason"))
    if why is not None:
        raise ApiError(400, why, "mode")


def admit(worker) -> None:
    """Refuse a new job with 503 unless ``worker`` (either engine's) is ready and its queue has
    room (``Retry-After`` says when to try again)."""
    if worker.state == "failed":
        raise ApiError(503, f"the model failed to load: {worker.error}", kind="server_error")
    if not worker.ready:
        raise ApiError(
            503, "the model is still loading", kind="server_busy", headers={"Retry-After": "5"}
        )
    limit = worker.settings.max_queue
    if worker.queue_depth >= limit:
        worker.metrics.rejected.inc()
        raise ApiError(
            503,
            f"the queue is full ({limit} requests waiting): retry later",
            kind="server_busy",
            headers={"Retry-After": "1"},
        )
