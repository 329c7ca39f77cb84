"""The serving engines behind the routes: one protocol, two implementations, typed events.

- :mod:`~app.engines.jobs` — :class:`~app.engines.jobs.Job` (a request as the event loop and
  the engine's threads both see it), its typed events (``PromptReady``, ``Tokens``,
  ``Finished``, ``JobFailed``), what a prompt builder may use, and the refusals before a job
  queues;
- :mod:`~app.engines.own` — :class:`~app.engines.own.EngineWorker`, the project's engine on a
  thread of its own;
- :mod:`~app.engines.vllm` — :class:`~app.engines.vllm.VllmWorker`, vLLM's engine with the D3D
  proposer (its sampling parameters: :mod:`~app.engines.vllm_requests`).

Routes, the app and the Ray deployment hold a :class:`ServingEngine` and never ask which one it
is; :func:`make_engine` is the one place that chooses (``--engine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.engines.jobs import Job, Models
    from app.metrics import Metrics
    from app.settings import ServeSettings


class ServingEngine(Protocol):
    """What the routes and the app use of an engine (either implementation)."""

    settings: ServeSettings
    metrics: Metrics
    state: str  # loading, ready, restarting, stopping, failed
    error: str
    models: Models | None  # what prompt builders use, once loaded
    detokenizer: object  # the event loop's own tokenizer copy, once loaded
    on_fatal: Callable[[str], None] | None  # called once the engine cannot serve again

    @property
    def ready(self) -> bool: ...

    @property
    def model_info(self) -> dict: ...

    @property
    def queue_depth(self) -> int: ...

    def start(self) -> None:
        """Load on a thread of its own (idempotent); ``state`` says when it is ready."""
        ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def submit(self, job: Job) -> None:
        """Queue ``job`` or refuse it at once (an ``ApiError``: 503 not ready or full, 400 a
        mode that cannot run here); its events arrive on ``job.events``."""
        ...

    def drafter_worker(self) -> dict | None:
        """The drafter worker's state, pid and restarts (None: no drafter)."""
        ...


def make_engine(settings: ServeSettings, metrics: Metrics, engine_factory=None) -> ServingEngine:
    """The engine ``settings.engine`` names (``engine_factory``: how the own engine loads its
    models; tests pass tiny ones)."""
    if settings.engine == "vllm":
        from app.engines.vllm import VllmWorker

        return VllmWorker(settings, metrics)
    from app.engines.own import EngineWorker, load_engine

    return EngineWorker(settings, metrics, engine_factory or load_engine)


__all__ = ["ServingEngine", "make_engine"]
