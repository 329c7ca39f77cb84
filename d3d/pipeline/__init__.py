"""Asynchronous decoupled drafting: the drafter prepares the next block while the target verifies.

- :mod:`~d3d.pipeline.protocol` — the messages (token ids, and sparse q when sampling).
- :mod:`~d3d.pipeline.branches` — which outcomes of a round to prepare blocks for (pure).
- :mod:`~d3d.pipeline.drafting` — the drafter's chain and packed-branch forwards.
- :mod:`~d3d.pipeline.budget` — how many branches fit inside a verification (online).
- :mod:`~d3d.pipeline.server` — the worker's logic: sessions, hits and misses.
- :mod:`~d3d.pipeline.workers` — where it runs: a thread, or a process pinned to its own cores.
- :mod:`~d3d.pipeline.proposer` — the target's side: the ``async`` proposer.
"""

from d3d.pipeline.proposer import AsyncProposer, WorkerLink
from d3d.pipeline.server import DraftServer, ServerConfig
from d3d.pipeline.workers import ProcessWorker, ThreadWorker, WorkerClient, pin_process

__all__ = [
    "AsyncProposer",
    "DraftServer",
    "ProcessWorker",
    "ServerConfig",
    "ThreadWorker",
    "WorkerClient",
    "WorkerLink",
    "pin_process",
]
