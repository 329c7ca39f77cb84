"""Asynchronous decoupled drafting: the drafter prepares the next block while the target verifies.

- :mod:`~d3d.worker.protocol` — the messages (token ids, and sparse q when sampling).
- :mod:`~d3d.worker.branches` — which outcomes of a round to prepare blocks for (pure).
- :mod:`~d3d.worker.drafting` — the drafter's chain and packed-branch forwards.
- :mod:`~d3d.worker.budget` — how many branches fit inside a verification (online).
- :mod:`~d3d.worker.server` — the worker's logic: sessions, hits and misses.
- :mod:`~d3d.worker.workers` — where it runs: a thread, or a process pinned to its own cores.
- :mod:`~d3d.worker.proposer` — the target's side: the ``async`` proposer.
"""

from d3d.worker.proposer import AsyncProposer, WorkerLink
from d3d.worker.server import DraftServer, ServerConfig
from d3d.worker.workers import ProcessWorker, ThreadWorker, WorkerClient, pin_process

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
