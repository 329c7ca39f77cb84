"""The service on vLLM's engine (``d3d serve --engine vllm``): the same routes, vLLM decoding.

:class:`VllmWorker` has the surface of :class:`~app.engines.own.EngineWorker` that the routes use
(``submit``, ``state``, ``detokenizer``, ``model_info``, ``metrics``), so ``/qa``, the OpenAI
routes, ``/metrics`` and the page are unchanged. What differs:

- Decoding is vLLM's ``AsyncLLM`` (its own engine process; paged KV, its scheduler, CUDA graphs
  on a GPU), with the D3D drafter as its speculative proposer (:mod:`d3d.vllm.proposer`, its
  worker on the drafter's device). Each request's mode travels as ``extra_args["d3d_mode"]``;
  a request is abandoned (client gone, timeout, stop string) by cancelling its task, which
  aborts it in vLLM.
- This process holds no model: the target's tokenizer and configs only
  (:func:`~d3d.model.load.load_text`). Prompts are built as on the own engine
  (:func:`~app.engines.own.build_prompt`): chat prompts on a prompt thread; a ``/qa`` document is
  read by the drafter worker, on the drafter's device, beside its drafting
  (:mod:`d3d.worker.reading`, :class:`~app.documents.WorkerReader`), so the drafter exists once
  and a kept prompt is the own engine's; without a drafter, the lexical scorers read here.
- Per-request speculative figures (drafts, acceptance, branch hits and misses) come from the
  proposer over its Unix socket (:mod:`d3d.vllm.stats`), as does the drafter worker's state;
  ``/metrics`` adds vLLM's own metrics (``vllm:spec_decode_*``).

The tokenizer and vLLM's engine load on a thread at start; the warm-up runs on
the event loop (vLLM's output handler lives there): it waits for the drafter worker, then sends
short ``ar`` and ``sync`` requests and one ``auto`` request alone (the proposer's policy learns
the host's costs from rows that run alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from app.documents import Documents, RemoteDocuments, WorkerReader
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
from app.engines.vllm_requests import STOP_REASONS, sampling_params, token_logprobs
from app.errors import ApiError
from app.metrics import Metrics
from app.prepared import Prepared
from app.settings import ServeSettings
from d3d.backends.sizes import kv_bytes_per_token
from d3d.config import SamplingConfig
from d3d.model.load import TargetText, load_text
from d3d.model.specs import speculation
from d3d.vllm import VLLM_VERSION
from d3d.vllm.engine import engine_args, on_vllm_cores, prepare_env, speculative_config
from d3d.vllm.proposer import worker_cores
from d3d.vllm.stats import StatsClient, StatsPoller
from d3d.worker import private
from d3d.worker.codec import import_name
from d3d.worker.reading import ReadClient, ReaderSpec

log = logging.getLogger("app.vllm")


class _Abort:
    """What ``Job.cancel`` calls: cancel the job's task on its loop (vLLM then aborts it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task):
        self.loop, self.task = loop, task

    def cancel(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)


class VllmWorker:
    """The routes' engine worker on vLLM (see the module docstring)."""

    def __init__(self, settings: ServeSettings, metrics: Metrics, engine_factory=None):
        self.settings, self.metrics = settings, metrics
        self.state, self.error = "loading", ""
        self.text: TargetText | None = None  # the tokenizer and configs (no weights)
        self.reading: ReadClient | None = None  # documents read in the drafter worker
        self.models: Models | None = None
        self.detokenizer = None
        self.llm = None
        self._info: dict = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._waiting = 0  # submitted, no token yet
        self._running = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prompts = ThreadPoolExecutor(1, thread_name_prefix="d3d-prompts")
        self._reader = ThreadPoolExecutor(
            1, thread_name_prefix="d3d-reader", initializer=self._reader_cores
        )
        # The stats socket and the draft flag: a private folder of this server, gone at stop.
        self.run_dir = private.make()
        self.stats_path = os.path.join(self.run_dir, "stats.sock")
        self.stats = StatsClient(self.stats_path)
        self.poller = StatsPoller(self.stats, tick=self._check_engine)
        self.on_fatal = None  # called once vLLM's engine is dead (app.lifecycle: exit)
        metrics.watch_worker(self.drafter_worker)
        metrics.watch_proposer(lambda: self.poller.totals)
        metrics.add_registry(_vllm_registry)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._load, name="d3d-vllm-load", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Close vLLM (its processes, the proposer's worker), the prompt and reader threads,
        the reading models, and the private folder."""
        self.poller.stop()
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.shutdown()
        self._prompts.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self.reading is not None:
            self.reading.close()
        self.stats.close()
        private.remove(self.run_dir)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def model_info(self) -> dict:
        return self._info

    def drafter_worker(self) -> dict | None:
        """The proposer's drafter worker: state, pid, restarts (None: no drafter)."""
        if not self._info.get("drafter"):
            return None
        totals = self.poller.totals  # polled on a thread: never a socket call on the loop
        if not isinstance(totals, dict) or totals.get("worker") is None:
            return {"state": "down", "pid": None, "restarts": 0}
        return totals["worker"]

    def _load(self) -> None:
        try:
            self._load_models()
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("loading failed")
            return
        assert self._loop is not None
        self.poller.start()
        asyncio.run_coroutine_threadsafe(self._warmup(), self._loop)

    def _check_engine(self) -> None:
        """After each poll: vLLM's engine died (its engine core, its output handler) means no
        request can be served again in this process: not ready, and the process exits."""
        llm = self.llm
        if llm is None or not getattr(llm, "errored", False) or self.state == "failed":
            return
        self.state, self.error = "failed", "vLLM's engine died"
        log.error("vLLM's engine died: the service stops so that its supervisor restarts it")
        if self.on_fatal is not None:
            self.on_fatal(self.error)

    def _load_models(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        s, cfg = self.settings, self.settings.model
        drafter = speculative_config(cfg) is not None
        # No weights here: the tokenizer and configs only. Documents are read by the drafter
        # worker, on the drafter's device (app.documents.WorkerReader), where the one drafter is.
        self.text = text = load_text(cfg.target)
        reader = None
        if drafter:
            path = os.path.join(self.run_dir, "read.sock")
            fields = {
                "target": cfg.target,
                "cache_dir": s.doc_cache_dir,
                "cache_max_bytes": s.doc_cache_max_bytes,
            }
            reader = ReaderSpec(import_name(WorkerReader), fields, path)
            self.reading = ReadClient(path)
            docs = lambda: RemoteDocuments(self.reading, text.tokenizer)  # noqa: E731
        else:  # no drafter anywhere: the lexical scorers, here
            docs = lambda: Documents.without_models(text, s.doc_cache_dir, s.doc_cache_max_bytes)  # noqa: E731
        prepare_env(cfg, mode="auto", stats_path=self.stats_path, reader=reader)
        args = engine_args(
            cfg,
            served_name=s.served_model_name or "default",
            max_batch=s.max_batch,
            eager=s.vllm_eager,
            kv_bytes=None,
        )
        if cfg.max_kv_tokens:  # the same budget in vLLM's unit (bytes of its KV dtype)
            per_token = kv_bytes_per_token(text.config, _dtype(args["dtype"]))
            args["kv_cache_memory_bytes"] = cfg.max_kv_tokens * per_token
        log.info("vLLM engine arguments: %s", args)
        with on_vllm_cores(cfg):  # vLLM's processes stay off a drafter's own cores
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self.models = Models(text, docs)
        self.detokenizer = copy.deepcopy(text.tokenizer)
        self.eos = set(text.eos_token_ids)
        vc = self.llm.vllm_config
        self._info = {
            "engine": "vllm",
            "vllm_version": VLLM_VERSION,
            "target": cfg.target,
            "target_device": cfg.target_device,
            "dtype": args["dtype"],
            "window": vc.model_config.max_model_len,
            "drafter": cfg.drafter if drafter else None,
            "drafter_device": cfg.drafter_device or cfg.resolved_drafter_device
            if drafter
            else None,
            "block_size": 16 if drafter else None,
            "reading": "drafter worker" if drafter else "api process (no model)",
            **speculation(cfg.drafter, cfg.target).to_dict(),
            "max_kv_tokens": cfg.max_kv_tokens,
            "load_seconds": round(time.perf_counter() - t0, 2),
        }
        log.info("loaded %s", self._info)

    async def _warmup(self) -> None:
        """Wait for the drafter worker, then a short request per mode (see below)."""
        try:
            if self._info.get("drafter"):
                for _ in range(1200):
                    w = self.drafter_worker()
                    if w and w.get("state") == "up":
                        break
                    await asyncio.sleep(0.5)
            if self.settings.warmup:
                # ar and sync prove both paths; auto alone, long enough to time a plain step
                # and a speculative round, gives the proposer's policy its host costs (it
                # measures them only on rows that run alone).
                ids = self.text.encode("Write a short story about a lighthouse keeper.", True)
                runs = [("ar", 8)] + (
                    [("sync", 8), ("auto", 48)] if self._info.get("drafter") else []
                )
                for mode, n in runs:
                    sp = sampling_params(SamplingConfig(), n, self.eos, mode)
                    async for _ in self.llm.generate(
                        {"prompt_token_ids": ids}, sp, f"warmup-{mode}"
                    ):
                        pass
            self.state = "ready"
            log.info(
                "ready on vLLM (max batch %d, max queue %d)",
                self.settings.max_batch,
                self.settings.max_queue,
            )
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("warm-up failed")

    # -- jobs ----------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._waiting

    def submit(self, job: Job) -> None:
        admit(self)
        check_mode(self, job.mode)
        self._waiting += 1
        self.metrics.queue_depth.set(self._waiting)
        task = asyncio.get_running_loop().create_task(self._serve(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        job.reqs = [_Abort(asyncio.get_running_loop(), task)]

    async def _serve(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        started = False
        try:
            job.dequeued = time.perf_counter()
            pool = self._reader if job.reads_document else self._prompts
            prepared: Prepared | None = await loop.run_in_executor(
                pool, build_prompt, job, self.models
            )
            if prepared is None:
                return
            job.admitted = time.perf_counter()
            job.put(PromptReady(prepared))
            rid = f"d3d-{next(self._ids)}-{os.getpid()}"
            sp = sampling_params(
                job.sampling, job.max_new_tokens, self.eos, job.mode, job.n, job.logprobs
            )
            prompt = {"prompt_token_ids": prepared.prompt_ids}
            t0, first_at = time.perf_counter(), None
            counts, reasons = [0] * job.n, ["length"] * job.n
            async for out in self.llm.generate(prompt, sp, rid):
                for o in out.outputs:
                    i, ids = o.index, list(o.token_ids)
                    if ids:
                        if first_at is None:
                            first_at = time.perf_counter()
                            self.metrics.ttft.observe(first_at - job.submitted)
                            self._waiting, self._running = self._waiting - 1, self._running + 1
                            started = True
                            self._gauges()
                        counts[i] += len(ids)
                        lps = token_logprobs(o, ids) if job.logprobs is not None else None
                        job.put(Tokens(i, ids, lps))
                    if o.finish_reason:
                        reasons[i] = STOP_REASONS.get(o.finish_reason, o.finish_reason)
            d3d = await self._d3d_stats(loop, rid, job.mode)
            for i in range(job.n):
                stats = self._stats(
                    d3d, job, len(prepared.prompt_ids), counts[i], reasons[i], t0, first_at
                )
                self.metrics.observe_stats(stats if i == 0 else {**stats, "prompt_tokens": 0})
                job.put(Finished(i, stats))
        except asyncio.CancelledError:
            pass  # the client left or timed out: vLLM aborted the request
        except ValueError as exc:  # vLLM refuses the request (e.g. longer than its window)
            job.put(JobFailed(ApiError(400, str(exc))))
        except Exception as exc:
            if self.llm is not None and getattr(self.llm, "errored", False):
                self._check_engine()
                job.put(JobFailed(ApiError(503, "the engine died", kind="server_error")))
                return
            log.exception("a request failed on vLLM")
            job.put(JobFailed(ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")))
        finally:
            if started:
                self._running -= 1
            else:
                self._waiting -= 1
            self._gauges()

    def _reader_cores(self) -> None:
        """The reader thread reads on the drafter's CPU cores, never on vLLM's only ones."""
        if self.settings.model.target_device.startswith("cuda"):
            return
        cores = worker_cores(self.settings.model.drafter_device)
        if cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, set(cores))

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(self._waiting)
        self.metrics.running.set(self._running)

    async def _d3d_stats(self, loop, rid: str, mode: str) -> dict | None:
        """The proposer's figures for a finished request, asked off the event loop (a round
        trip to vLLM's busy runner process would hold up every stream); none for ``ar``
        (the proposer keeps no record of it)."""
        if not self._info.get("drafter") or mode == "ar":
            return None
        out = await loop.run_in_executor(None, self.stats.ask, "request", rid)
        return out if isinstance(out, dict) else None

    def _stats(self, d3d, job, prompt_n, n, reason, t0, first_at) -> dict:
        now = time.perf_counter()
        decode_s = now - first_at if first_at is not None else 0.0
        stats = dict(d3d) if d3d else {}
        stats.update(
            mode=job.mode,
            prompt_tokens=prompt_n,
            num_tokens=n,
            stop_reason=reason,
            prefill_seconds=round((first_at or now) - t0, 4),
            decode_seconds=round(decode_s, 4),
            tokens_per_second=round(n / decode_s, 3) if decode_s > 0 else 0.0,
            engine="vllm",
        )
        return stats


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _vllm_registry():
    """vLLM's Prometheus registry (its ``vllm:*`` metrics), rendered after the service's."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()


__all__ = ["VllmWorker", "sampling_params"]
