"""The engine worker: one thread steps the engine; documents are read on another.

The event loop never touches a model. A route builds a :class:`Job` (a
:class:`~app.prepared.PromptBuilder` and decode settings) and :meth:`EngineWorker.submit`
queues it, or refuses at once with 503 and ``Retry-After`` when ``max_queue`` jobs are already
waiting. The engine thread loads the models, runs a tiny warm-up generation per mode (which
also calibrates the speculation policy), and then loops: take new jobs, build the prompts of
those that only tokenise, hand those that read a document to the reader thread, add prepared
requests to the engine's :class:`~d3d.engine.Scheduler`, run one step. The reader thread
compresses documents (its reader model is not the target: an int8 copy or the drafter) with a
tokenizer of its own, so a document being read never stalls the rows that are decoding; on a
host where the drafter has a device or core of its own, that is where this reading belongs.

Results flow back to the job's asyncio queue with ``call_soon_threadsafe``: ``("tokens", (i,
ids, logprobs))`` and ``("done", (i, stats))`` for each of the job's ``n`` rows (``n`` > 1:
independent samples of one prompt, read once through the prefix cache, row i seeded with
``seed + i``). Cancelling a job (client gone, timeout) drops its rows before the next step. A request the KV budget can never
hold is refused with 413 naming the limit; one that does not fit now waits for running rows.

A failure that escapes the engine loop answers the worker's requests 503 at once and restarts
the loop after a backoff; a thread that ends before :meth:`EngineWorker.stop` fails the worker
and calls ``on_fatal`` (:mod:`app.watch`, :mod:`app.lifecycle`).

The engine thread shares the interpreter with the event loop (and the reader): every torch op
lets go of the GIL, and taking it back waits, when another thread holds it, until Python asks
that thread to hand it on, 5 ms by default. :meth:`EngineWorker.start` shortens that to
:data:`SWITCH_S` for the process: streaming clients gain a little, long prompts (where the engine
thread sits inside long ops) nothing (measured: docs/results.md, "Figures from the code's
docstrings").
"""

from __future__ import annotations

import copy
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace

from app.documents import Documents
from app.engines.jobs import (
    Finished,
    Job,
    JobFailed,
    Models,
    PromptReady,
    Tokens,
    admit,
    build_prompt,
    check_mode,
)
from app.errors import ApiError
from app.metrics import Metrics
from app.prepared import Prepared
from app.settings import ServeSettings
from app.watch import Restarts, fail_jobs, watched
from d3d.engine import GenRequest, KvLimitError, PrefillBudget, Scheduler

log = logging.getLogger("app.engines.own")

SWITCH_S = 0.0005  # the GIL's hand-over interval while the engine runs (module docstring)

__all__ = ["EngineWorker", "Job", "Models", "Prepared", "admit", "build_prompt", "load_engine"]


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
        self.batch: Scheduler | None = None
        self.model_info: dict = {}
        self._inbox: queue.Queue = queue.Queue()  # ("job", Job) and ("ready", Job, Prepared)
        self._reading: queue.Queue[Job | None] = queue.Queue()
        self._pending = 0  # jobs submitted and not yet in the engine (queue depth)
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None  # made in start(): apps get pickled (Ray)
        self._reader: threading.Thread | None = None
        self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()  # submitted, not yet collected
        self.restarts = Restarts()
        self.on_fatal: Callable[[str], None] | None = None  # app.lifecycle: drain and exit
        metrics.watch_worker(self.drafter_worker)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker threads (idempotent: an ASGI lifespan and a Ray replica may both
        ask)."""
        with self._start_lock:
            if self._thread is None:
                sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_S))
                run, read = (
                    watched(t, self._stop.is_set, self._fatal) for t in (self._run, self._read)
                )
                self._thread = threading.Thread(target=run, name="d3d-engine", daemon=True)
                self._thread.start()
                self._reader = threading.Thread(target=read, name="d3d-reader", daemon=True)
                self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop both threads, then close the engine (its drafter worker process with it)."""
        self._stop.set()
        self._reading.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        if self.engine is not None and not (self._thread and self._thread.is_alive()):
            self.engine.close()

    @property
    def ready(self) -> bool:
        threads = (self._thread, self._reader)
        return self.state == "ready" and all(t is not None and t.is_alive() for t in threads)

    def _fatal(self, why: str) -> None:
        """A thread ended before stop() (:mod:`app.watch`): failed for good, and exit."""
        if self.state == "failed":  # the models failed to load: reported, nothing admitted
            return
        self.state, self.error = "failed", why
        fail_jobs(list(self._jobs), self.error)
        if self.on_fatal is not None:
            self.on_fatal(self.error)

    def drafter_worker(self) -> dict | None:
        """The drafter worker's state, pid and restarts (None: the engine has none)."""
        engine = self.engine
        return engine.worker_status() if engine is not None else None

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("model loading failed: %s", self.error)
            return
        while not self._stop.is_set():
            try:
                self._take(block=self.batch.idle)
                if not self.batch.idle:
                    self.batch.step()
            except Exception as exc:  # the loop restarts; its requests are answered 503
                self._restart(exc)
            self.metrics.queue_depth.set(self.queue_depth)
            self.metrics.running.set(len(self.batch.rows))
            self.metrics.kv_in_use.set(self.batch.kv.reserved)

    def _restart(self, exc: Exception) -> None:
        """After a failure outside the scheduler's own guard: not ready, fail and cancel every
        request (their rows leave at the next step), wait out the backoff, serve again; the
        failure that repeats too often (:class:`~app.watch.Restarts`) ends the thread."""
        log.exception("the engine loop failed: restarting it")
        self.state, self.error = "restarting", f"{type(exc).__name__}: {exc}"
        fail_jobs(list(self._jobs), f"the engine restarted after {self.error}")
        delay = self.restarts.next_delay()
        if delay is None:
            raise RuntimeError(f"the engine loop failed {self.restarts.count} times") from exc
        self._stop.wait(delay)
        self.state = "ready"
        log.info("the engine loop serves again (restart %d)", self.restarts.count)

    def _load(self) -> None:
        t0 = time.perf_counter()
        engine = self.engine = self.engine_factory(self.settings)
        s = self.settings
        self.models = Models(
            engine, lambda: Documents.for_engine(engine, s.doc_cache_dir, s.doc_cache_max_bytes)
        )
        # The event loop decodes text with its own copy: a Rust tokenizer borrowed by the worker
        # thread (encoding) cannot be used from another thread at the same moment.
        self.detokenizer = copy.deepcopy(engine.tokenizer)
        self.batch = engine.scheduler(
            max_batch=self.settings.max_batch,
            prefill=PrefillBudget(
                share=self.settings.prefill_share, floor_s=self.settings.prefill_floor
            ),
        )
        model = engine.target.model
        p = next(model.parameters())
        drafter = engine.drafter
        kv = self.batch.kv
        self.model_info = {
            "target": engine.target.spec,
            "target_device": str(p.device),
            "dtype": str(p.dtype).replace("torch.", ""),
            "parameters": sum(x.numel() for x in model.parameters()),
            "window": self.batch.window,
            "vocab_size": engine.target.vocab_size,
            "drafter": None if drafter is None else self.settings.model.drafter,
            "drafter_device": None if drafter is None else str(drafter.device),
            **engine.speculation.to_dict(),
            "block_size": self.batch.block_size,
            "max_kv_tokens": kv.max_tokens,
            "kv_bytes_per_token": kv.bytes_per_token,
            "load_seconds": round(time.perf_counter() - t0, 2),
        }
        log.info("loaded %s", self.model_info)
        if self.settings.warmup:
            self._warmup()
        self.state = "ready"
        log.info(
            "ready: max batch %d, max queue %d, KV budget %d tokens",
            self.settings.max_batch,
            self.settings.max_queue,
            kv.max_tokens,
        )

    def _warmup(self) -> None:
        """Every step graph the backend can take now (no request then waits for a capture), then
        a tiny generation per mode: proves the models run and calibrates the policy."""
        engine = self.engine
        captured, capture_s = engine.capture()
        ids = engine.encode("Say hello.", True)
        figures = engine.calibrate()
        modes = ["ar"] + (["sync"] if engine.drafter is not None else [])
        for mode in modes:
            self.batch.add(GenRequest(ids, max_new_tokens=8 if mode == "ar" else 24, mode=mode))
            while not self.batch.idle:
                self.batch.step()
        # The first document would otherwise build the reader (an int8 copy of the reading layers)
        # inside its own request, and every request behind it would wait for that.
        t0 = time.perf_counter()
        try:
            self.models.documents.reader.compressor()
        except Exception:  # documents then fail or build it on first use; chat is unaffected
            log.exception("building the document reader at warm-up failed")
        reader_s = time.perf_counter() - t0
        # A burst of requests allocates its rows' KV in one step: fault that memory in now.
        touched = self.batch.kv.pretouch(self.settings.max_batch)
        h = engine.host
        summary = {
            "step_ms": _ms(h.step_s.value),
            "verify_token_ms": _ms(h.per_token_s.value),
            "draft_ms": _ms(h.wait_s.value),
            "calibrated": figures is not None,
            "reader_s": round(reader_s, 2),
            "graphs_captured": captured,
            "capture_s": round(capture_s, 2),
            "kv_pretouch_s": None if touched is None else round(touched, 2),
        }
        self.model_info["warmup"] = summary
        log.info("warm-up done: %s", summary)

    # -- jobs ----------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        waiting = len(self.batch.waiting) if self.batch is not None else 0
        return self._pending + waiting

    def submit(self, job: Job) -> None:
        admit(self)
        check_mode(self, job.mode)
        self._count(+1)
        self._jobs.add(job)
        self._inbox.put(("job", job))

    def _count(self, n: int) -> None:
        with self._pending_lock:
            self._pending += n

    def _take(self, block: bool) -> None:
        """Everything the inbox holds now (waiting a little for it when the engine is idle)."""
        try:
            item = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "job":
                self._dispatch(item[1])
            else:
                self._count(-1)
                self._admit(item[1], item[2])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, job: Job) -> None:
        """Build a prompt that only tokenises here; send a document to the reader thread."""
        job.dequeued = time.perf_counter()
        if job.reads_document:
            self._reading.put(job)
            return
        self._count(-1)
        prepared = self._prepare(job)
        if prepared is not None:
            self._admit(job, prepared)

    def _read(self) -> None:
        """The reader thread: compress documents, hand their prompts to the engine thread. It
        reads on the drafter's cores where the drafter has its own, never on the target's."""
        spared = False
        while not self._stop.is_set():
            job = self._reading.get()
            if job is None:
                return
            try:
                if not spared:  # jobs arrive only once the engine is loaded
                    self.engine.spare_thread()
                    spared = True
                with self.engine.reading():
                    prepared = self._prepare(job)
            except Exception as exc:  # this job fails with 503; the reader goes on
                log.exception("reading a document failed")
                fail_jobs([job], f"reading the document failed: {type(exc).__name__}")
                prepared = None
            if prepared is None:
                self._count(-1)
            else:
                self._inbox.put(("ready", job, prepared))

    def _prepare(self, job: Job) -> Prepared | None:
        return build_prompt(job, self.models)

    def _admit(self, job: Job, prepared: Prepared) -> None:
        """Add a prepared job's rows to the engine (engine thread only)."""
        if job.cancelled:
            return
        # n rows of one prompt read it once: the first reads it into the prefix cache, the
        # others copy it (d3d.engine.prefixes); a lone chat shares its system turn.
        common = len(prepared.prompt_ids) - 1 if job.n > 1 else prepared.head
        shared = prepared.shared_prefix or common
        reqs = [self._request(job, prepared, i, shared) for i in range(job.n)]
        try:
            self.batch.check(reqs[0])  # the rows are alike: all fit or none does
        except KvLimitError as exc:
            job.put(JobFailed(ApiError(413, str(exc), "max_new_tokens", kind="kv_limit")))
            return
        except ValueError as exc:
            job.put(JobFailed(ApiError(400, str(exc))))
            return
        job.reqs = reqs
        for req in reqs:
            self.batch.add(req)
        job.admitted = time.perf_counter()
        if job.cancelled:
            job.cancel()
        job.put(PromptReady(prepared))

    def _request(self, job: Job, prepared: Prepared, i: int, shared: int) -> GenRequest:
        """Row ``i`` of a job (seeded ``seed + i``: the rows are independent samples)."""
        sampling = job.sampling
        if i and sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + i)
        pending: list = []  # the chunk's logprobs, which arrive just before its tokens

        def on_tokens(ids: list[int]) -> None:
            self._on_tokens(job, i, ids, pending.pop() if pending else None)

        return GenRequest(
            prepared.prompt_ids,
            max_new_tokens=job.max_new_tokens,
            sampling=sampling,
            mode=job.mode,
            shared_prefix=shared,
            copy=self.settings.copy,
            on_tokens=on_tokens,
            on_finish=lambda stats, err: self._on_finish(job, i, stats, err),
            logprobs=job.logprobs,
            on_logprobs=pending.append if job.logprobs is not None else None,
        )

    def _on_tokens(self, job: Job, i: int, ids: list[int], logprobs) -> None:
        if not job.first:
            job.first = True
            self.metrics.ttft.observe(time.perf_counter() - job.submitted)
        job.put(Tokens(i, ids, logprobs))

    def _on_finish(self, job: Job, i: int, stats, error: BaseException | None) -> None:
        d = stats.to_dict()
        self.metrics.observe_stats(d if i == 0 else {**d, "prompt_tokens": 0})  # one prompt
        job.put(JobFailed(error) if error is not None else Finished(i, d))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
