"""One clock for every timing that decides anything (the policy, the prefill budget, branches).

A CPU wall clock around an asynchronous GPU call measures the launch, not the work. The clock
waits for the device before it reads the time: :meth:`Clock.now` waits for the calling thread's
current stream on each device it was given (a no-op on a CPU), so ``now() - t0`` around a forward
is the forward's real time, and a drafter thread on a stream of its own neither waits for the
target's kernels nor makes the target's clock wait for its own.
:meth:`Clock.wall` reads the host's time without waiting: for a moment when the host has just
waited for the device anyway (after a step's accepted tokens came back, before the next step is
queued), so a step pays for one wait, never one per timing or per row. The cuda backend times
its forwards with CUDA events instead (:mod:`d3d.backends.cuda.target`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch


class Clock:
    """Seconds, read after the given devices have finished their queued work."""

    def __init__(self, devices: Iterable[torch.device | str] = ()):
        self.cuda = sorted(
            {torch.device(d) for d in devices if torch.device(d).type == "cuda"}, key=str
        )

    def sync(self) -> None:
        for dev in self.cuda:
            torch.cuda.current_stream(dev).synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def wall(self) -> float:
        """The host's time, without waiting for the devices (module docstring)."""
        return time.perf_counter()


WALL = Clock()  # for CPU-only callers and tests
