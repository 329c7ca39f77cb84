"""The engine's drafter worker and the CPU budget it leaves the target.

:class:`DrafterHost` starts the worker once, on first use or at load, where
:mod:`d3d.engine.placement` says (its own process pinned to its own cores on a CPU host, a thread
beside a GPU drafter), under a :class:`~d3d.worker.supervisor.Supervisor` that replaces it when
it dies or hangs, and stops it with the engine. Where a drafter
process holds cores of its own, the target's process keeps to the others while rows speculate
and gets every core back for plain steps (a drafter that is not drafting must not cost the target
a core); threads that read documents beside decoding are kept off the target's cores for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from d3d.config import ModelConfig
from d3d.engine.loading import DrafterFactory, placement_for
from d3d.engine.placement import Placement
from d3d.worker import ProcessWorker, ThreadWorker, WorkerClient, pin_process
from d3d.worker.supervisor import Supervisor, SupervisorConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuBudget:
    """This process's CPU budget beside a drafter process: ``full`` is what it had before
    (plain steps and ``close`` go back to it), ``own`` its share while the drafter drafts;
    each is (cores, torch threads)."""

    full: tuple[set[int], int]
    own: tuple[set[int], int]


def launch_process(
    cfg: ModelConfig, place: Placement, factory=None
) -> tuple[WorkerClient, CpuBudget | None] | None:
    """Start a drafter process where ``place`` says and pin this process to the other cores.
    Returns the worker and the CPU budget it leaves this process (None when ``place`` is a
    thread)."""
    if place.kind != "process":
        return None
    log.info(
        "drafter worker: own process on core(s) %s; target on core(s) %s",
        list(place.drafter_cores),
        list(place.target_cores),
    )
    worker = ProcessWorker(factory or DrafterFactory(cfg), list(place.drafter_cores))
    budget = None
    if place.target_cores:
        threads = len(place.target_cores)
        budget = CpuBudget(
            full=(os.sched_getaffinity(0), torch.get_num_threads()),
            own=(set(place.target_cores), min(threads, cfg.threads or threads)),
        )
        pin_process(sorted(budget.own[0]), budget.own[1])
    return worker, budget


class DrafterHost:
    """The drafter worker of one engine (see the module docstring)."""

    def __init__(
        self,
        model_cfg: ModelConfig | None,
        target_device: str,
        drafter,
        supervision: SupervisorConfig | None = None,
    ):
        """``supervision``: how the worker is watched; :attr:`factory` (settable before the
        worker starts) builds the drafter in a worker process (default: from the model specs)."""
        self.model_cfg = model_cfg
        self.factory = DrafterFactory(model_cfg) if model_cfg is not None else None
        self.target_device = target_device
        self.drafter = drafter
        self.supervision = supervision
        self.manage_cpu = True  # False: the caller sets this process's CPU budget itself
        self._sup: Supervisor | None = None
        self._lock = threading.Lock()
        self._cpu: CpuBudget | None = None  # set while a drafter process holds cores
        self._cpu_state: bool | None = None  # the budget in force (True: the drafter's share)
        self._spare: set[int] = set()  # threads kept off the target's cores
        self._reading = 0  # documents being read on the drafter's device now
        self._reading_lock = threading.Lock()

    def adopt(self, started: tuple[WorkerClient, CpuBudget | None]) -> None:
        """Take a worker started before the engine existed (it loads while the target does)."""
        first, self._cpu = started
        with self._lock:
            self._sup = Supervisor(self._starter(first), self.supervision)

    @property
    def restarts(self) -> int:
        return self._sup.restarts if self._sup is not None else 0

    def status(self) -> dict | None:
        """The worker's state for ``/ready`` (None: this engine has no drafter worker)."""
        return self._sup.status() if self._sup is not None else None

    def worker(self, wait: bool = True, timeout: float = 600.0) -> Supervisor | None:
        """The drafter worker's supervisor, started on first use; None without a drafter.
        ``wait``: wait until the first worker is ready (a replacement is never waited for: the
        requests meanwhile take plain steps)."""
        if self.drafter is None:
            return None
        with self._lock:
            if self._sup is None:
                self._sup = Supervisor(self._starter(None), self.supervision)
            sup = self._sup
        if wait and sup.state == "starting" and not sup.wait_ready(timeout):
            log.error("the drafter worker did not start; speculation falls back")
            return None
        return sup

    def _starter(self, first: WorkerClient | None):
        """The supervisor's way to make a worker: ``first`` once (if given), then new ones."""
        pending = [first] if first is not None else []

        def start() -> WorkerClient | None:
            if pending:
                return pending.pop()
            return self._start()

        return start

    def _start(self) -> WorkerClient | None:
        cfg = self.model_cfg or ModelConfig(target_device=self.target_device)
        place = placement_for(cfg)
        if place.kind == "process" and self.model_cfg is not None:
            if self._cpu is None:
                started = launch_process(cfg, place, self.factory)
                assert started is not None
                worker, self._cpu = started
                return worker
            return ProcessWorker(self.factory, list(place.drafter_cores))
        return ThreadWorker(self.drafter) if self.drafter is not None else None

    def _close(self) -> None:
        if self._sup is not None:
            self._sup.close()
            self._sup = None
        if self._cpu is not None:
            cores, threads = self._cpu.full
            pin_process(sorted(cores), threads)
            self._cpu = self._cpu_state = None

    def cpu_budget(self, speculating: bool) -> None:
        """The target's cores for its next step: fewer while the drafter process drafts."""
        if self._cpu is None or not self.manage_cpu or self._cpu_state is speculating:
            return
        cores, threads = self._cpu.own if speculating else self._cpu.full
        pin_process(sorted(cores), threads, self._spare)
        self._cpu_state = speculating

    def spare_thread(self) -> None:
        """Keep the calling thread off the target's cores for good: on the drafter process's
        cores where it has its own, otherwise wherever the OS puts it."""
        self._spare.add(threading.get_native_id())
        if self._cpu is not None:
            spare = self._cpu.full[0] - self._cpu.own[0]
            if spare:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, spare)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Mark the drafter's device busy with other work (see :meth:`busy`)."""
        with self._reading_lock:
            self._reading += 1
        try:
            yield
        finally:
            with self._reading_lock:
                self._reading -= 1

    def busy(self) -> bool:
        """Whether the drafter's device is reading a document now: a drafter process shares
        its core with the reader, so blocks asked for meanwhile would wait for the reading."""
        return self._reading > 0

    def close(self) -> None:
        """Stop the worker (and give the target its cores back)."""
        with self._lock:
            self._close()
