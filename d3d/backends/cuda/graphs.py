"""CUDA graphs of the decode step, one per shape, captured on first use and replayed after.

A step's shape is (B rows, T tokens a row, n keys attended) — for any inputs object, the shapes
of its tensors and n; its inputs live in one :class:`~d3d.backends.cuda.forward.StepInputs` per
(B, T) (the drafter's: one :class:`~d3d.backends.cuda.drafter.PackedInputs` per rows bucket,
chain width and branch count), so every graph of that shape reads the same addresses. The first step of a shape runs once eagerly on a side stream (cuBLAS and the
allocator settle), is captured into a graph that shares one memory pool with every other, and
is replayed at once, so it computes what an eager step would. The warm-up and the capture write
the step's new keys exactly where the step itself writes them (after each row's committed
length, positions no committed token holds), so capturing among live rows harms none. Later
steps of that shape copy their inputs in and replay: one launch for the whole forward.

Two threads capture in one process (the engine's target and a drafter worker's thread, on one
GPU or two), so a capture must not depend on, or disturb, the other: each :class:`Graphs` warms
up and captures on a stream of its own on its inputs' device (``torch.cuda.graph``'s default
capture stream is one per process, made on whichever device captured first); the capture mode is
``thread_local``, so the other thread's allocations and waits on its own streams stay legal while
this one captures; and :data:`CAPTURE` lets one capture run at a time in the process, since
``torch.cuda.graph`` synchronises the device and empties the allocator's cache as it begins,
neither of which may happen while another thread's capture is under way.

:class:`Eager` has the same interface and runs the step each time (``graphs=False``);
:class:`~d3d.backends.cuda.rehearsal.Rehearsal` runs it as a graph would, checking each call
against the first, where ``graphs=True`` meets a device without CUDA (the CPU tests):
:func:`~d3d.backends.cuda.rehearsal.runner_for` picks.

Letters: B rows, T tokens a row, n keys attended, H hidden.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

Step = Callable[[Any, int], torch.Tensor]  # (inputs, n) -> hidden states [B*T, H]
CAPTURE = threading.Lock()  # one capture at a time in this process (module docstring)


class Runner(Protocol):
    """How a step target runs its decode steps: :class:`Graphs`, :class:`Eager`, or
    :class:`~d3d.backends.cuda.rehearsal.Rehearsal`."""

    captured: int
    shapes: int

    def run(self, inputs: Any, n: int) -> torch.Tensor: ...


def shape_key(inputs: Any, n: int) -> tuple:
    """A step's shape: the shapes of its inputs' tensors (a dataclass of tensors) and n."""
    return (*(tuple(v.shape) for v in vars(inputs).values()), n)


class Eager:
    """Runs the step each time; counts the shapes it met, as :class:`Graphs` does."""

    captured = 0

    def __init__(self, step: Step):
        self.step = step
        self.seen: set[tuple] = set()

    @property
    def shapes(self) -> int:
        """Shapes met so far (where :class:`Graphs` would have captured a graph for each)."""
        return len(self.seen)

    def run(self, inputs: Any, n: int) -> torch.Tensor:
        self.seen.add(shape_key(inputs, n))
        return self.step(inputs, n)


class Graphs:
    """A CUDA graph per shape (:func:`shape_key`), captured on first use (module docstring)."""

    def __init__(self, step: Step):
        self.step = step
        self.pool = None  # one memory pool shared by every graph (they never run at once)
        self.stream: torch.cuda.Stream | None = None  # this instance's capture stream
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def captured(self) -> int:
        return len(self.graphs)

    @property
    def shapes(self) -> int:
        """Shapes met so far: a graph captured for each (a step that met a new one paid for
        its warm-up and capture)."""
        return len(self.graphs)

    def run(self, inputs: Any, n: int) -> torch.Tensor:
        key = shape_key(inputs, n)
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            return out
        device = next(iter(vars(inputs).values())).device
        with CAPTURE, torch.cuda.device(device):
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
            stream, current = self.stream, torch.cuda.current_stream(device)
            stream.wait_stream(current)  # the inputs were written on the current stream
            with torch.cuda.stream(stream):
                self.step(inputs, n)  # warm-up: kernels chosen, workspaces allocated
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"
            ):
                out = self.step(inputs, n)
        self.pool = graph.pool()
        self.graphs[key] = (graph, out)
        graph.replay()  # capturing ran nothing: this is the step
        return out
