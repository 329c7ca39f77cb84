"""The engine worker: one thread owns the models; requests reach it through a bounded queue.

The event loop never touches a model. A route builds a :class:`Job` (how to build the prompt,
decode settings) and :meth:`EngineWorker.submit` queues it, or refuses at once with 503 and
``Retry-After`` when ``max_queue`` jobs are already waiting. The worker thread loads the models,
runs a tiny warm-up generation (which also calibrates the speculation policy's cost model), and
then loops: take new jobs, build their prompts (tokenising, compressing documents), add them to
the :class:`~d3d.batching.BatchEngine`, run one batched step. Results flow back to the job's
asyncio queue with ``call_soon_threadsafe``. Cancelling a job (client gone, timeout) drops its
row before the next round.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.errors import ApiError
from app.metrics import Metrics
from app.settings import ServeSettings
from d3d.batching import BatchEngine, GenRequest
from d3d.config import SamplingConfig
from d3d.kv_store import PrefixCache

log = logging.getLogger("app.worker")


@dataclass
class Prepared:
    """A job's prompt, built on the worker thread, and what building it reports."""

    prompt_ids: list[int]
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    shared_prefix: int = 0  # first prompt tokens other requests share (the engine caches their KV)


class Models:
    """What a job's ``prepare`` may use on the worker thread: the engine, and the document
    compressors (built on first use, then shared by every request)."""

    def __init__(self, engine, doc_cache_dir: str | None = None):
        self.engine = engine
        self.doc_cache_dir = doc_cache_dir
        self._documents = None

    @property
    def documents(self):
        if self._documents is None:
            from app.documents import Documents

            self._documents = Documents(self.engine, self.doc_cache_dir)
        return self._documents


class Job:
    """One request's generation, seen from both threads (events flow worker -> event loop)."""

    def __init__(
        self,
        prepare: Callable[[Models], Prepared],
        max_new_tokens: int,
        sampling: SamplingConfig,
        mode: str,
    ):
        self.prepare, self.max_new_tokens, self.sampling, self.mode = (
            prepare,
            max_new_tokens,
            sampling,
            mode,
        )
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.dequeued = 0.0  # the worker took it (queue time ends, prompt building starts)
        self.admitted = 0.0  # its prompt joined the batch's waiting list
        self.req: GenRequest | None = None
        self._cancelled = threading.Event()

    def put(self, kind: str, payload: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        self._cancelled.set()
        if self.req is not None:
            self.req.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def load_engine(settings: ServeSettings):
    from d3d.engine import Engine

    return Engine.from_config(settings.model)


class EngineWorker:
    """Owns the engine on its own thread (see the module docstring)."""

    def __init__(
        self,
        settings: ServeSettings,
        metrics: Metrics,
        engine_factory: Callable[[ServeSettings], object] = load_engine,
    ):
        self.settings, self.metrics, self.engine_factory = settings, metrics, engine_factory
        self.state = "loading"
        self.error = ""
        self.engine = None
        self.models: Models | None = None
        self.detokenizer = None
        self.batch: BatchEngine | None = None
        self.model_info: dict = {}
        self._inbox: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None  # made in start(): apps get pickled (Ray)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (idempotent: an ASGI lifespan and a Ray replica may both ask)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="d3d-engine", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("model loading failed: %s", self.error)
            return
        while not self._stop.is_set():
            self._take_jobs(block=self.batch.idle)
            if not self.batch.idle:
                self.batch.step()
            self.metrics.queue_depth.set(self.queue_depth)
            self.metrics.running.set(len(self.batch.rows))

    def _load(self) -> None:
        t0 = time.perf_counter()
        engine = self.engine = self.engine_factory(self.settings)
        self.models = Models(engine, self.settings.doc_cache_dir)
        # The event loop decodes text with its own copy: a Rust tokenizer borrowed by the worker
        # thread (encoding) cannot be used from another thread at the same moment.
        self.detokenizer = copy.deepcopy(engine.tokenizer)
        model = engine.target.model
        # The batched engine keeps its own prefix cache: a request computes the same numbers
        # whether or not its prefix was cached only if the entry came from the same path.
        self.batch = BatchEngine(
            model,
            engine.target.eos_token_ids,
            engine.drafter,
            max_batch=self.settings.max_batch,
            prefix_cache=PrefixCache(engine.prefix_cache.max_bytes, tag="batch"),
            copy=self.settings.copy,
        )
        p = next(model.parameters())
        drafter = engine.drafter
        self.model_info = {
            "target": engine.target.spec,
            "target_device": str(p.device),
            "dtype": str(p.dtype).replace("torch.", ""),
            "parameters": sum(x.numel() for x in model.parameters()),
            "window": self.batch.window,
            "drafter": None if drafter is None else self.settings.model.drafter,
            "drafter_device": None if drafter is None else str(drafter.device),
            "block_size": self.batch.block_size,
            "load_seconds": round(time.perf_counter() - t0, 2),
        }
        log.info("loaded %s", self.model_info)
        if self.settings.warmup:
            self._warmup()
        self.state = "ready"
        log.info(
            "ready: max batch %d, max queue %d", self.settings.max_batch, self.settings.max_queue
        )

    def _warmup(self) -> None:
        """A tiny generation per mode: proves the models run and calibrates the cost model."""
        ids = self.engine.encode("Say hello.", True)
        modes = ["ar"] + (["sync"] if self.engine.drafter is not None else [])
        for mode in modes:
            self.batch.add(GenRequest(ids, max_new_tokens=8 if mode == "ar" else 24, mode=mode))
            while not self.batch.idle:
                self.batch.step()
        c = self.batch.costs
        summary = {
            "step_ms": _ms(c.forward(1, 1)),
            "verify_ms": _ms(c.forward(1, self.batch.block_size)),
            "draft_ms": _ms(c.draft.value),
            "acceptance_length": round(self.batch.acceptance.value or 1.0, 2),
        }
        self.model_info["warmup"] = summary
        log.info("warm-up done: %s", summary)

    # -- jobs ----------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        waiting = len(self.batch.waiting) if self.batch is not None else 0
        return self._inbox.qsize() + waiting

    def submit(self, job: Job) -> None:
        if self.state == "failed":
            raise ApiError(503, f"the model failed to load: {self.error}", kind="server_error")
        if not self.ready:
            raise ApiError(
                503, "the model is still loading", kind="server_busy", headers={"Retry-After": "5"}
            )
        if self.queue_depth >= self.settings.max_queue:
            self.metrics.rejected.inc()
            raise ApiError(
                503,
                f"the queue is full ({self.settings.max_queue} requests waiting): retry later",
                kind="server_busy",
                headers={"Retry-After": "1"},
            )
        self._inbox.put(job)

    def _take_jobs(self, block: bool) -> None:
        try:
            job = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._start(job)
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _start(self, job: Job) -> None:
        if job.cancelled:
            return
        job.dequeued = time.perf_counter()
        try:
            prepared = job.prepare(self.models)
            req = GenRequest(
                prepared.prompt_ids,
                max_new_tokens=job.max_new_tokens,
                sampling=job.sampling,
                mode=job.mode,
                shared_prefix=prepared.shared_prefix,
                on_tokens=lambda ids: self._on_tokens(job, ids),
                on_finish=lambda stats, err: self._on_finish(job, stats, err),
            )
            self.batch.add(req)
        except ApiError as exc:
            job.put("error", exc)
            return
        except ValueError as exc:
            job.put("error", ApiError(400, str(exc)))
            return
        except Exception as exc:
            log.exception("preparing a request failed")
            job.put("error", exc)
            return
        job.req = req
        job.admitted = time.perf_counter()
        if job.cancelled:
            req.cancel()
        job.put("prepared", prepared)

    def _on_tokens(self, job: Job, ids: list[int]) -> None:
        if not getattr(job, "_first", False):
            job._first = True  # type: ignore[attr-defined]
            self.metrics.ttft.observe(time.perf_counter() - job.submitted)
        job.put("tokens", ids)

    def _on_finish(self, job: Job, stats, error: BaseException | None) -> None:
        d = stats.to_dict()
        self.metrics.observe_stats(d)
        job.put("error" if error is not None else "done", error if error is not None else d)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
