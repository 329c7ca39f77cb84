"""A step run as its CUDA graph would run it, on any device: what the CPU tests decode through.

A CUDA graph records a step's kernels once, with every argument the host gave them — the
addresses of the tensors they read and write, and each Python number (a slice's bound, a scalar
operand) — and each replay runs those kernels again on whatever the addresses hold then. So a
replay computes what the step would compute eagerly only where the step's work depends on its
inputs' *values* through the device alone. Eager steps on a CPU cannot tell the difference;
:class:`Rehearsal` can. It traces each call under a dispatch mode — every operation, its
non-tensor arguments, the shapes and dtypes of its tensors, and the address of every tensor it
reads that the step did not make (weights, the KV, the step's inputs) — and holds each call of a
shape to the first call's trace. A step fails (:class:`GraphHazard`) where a replay would go
wrong or a capture would be refused:

- it reads the device from the host mid-step (``.item()``, a branch on a tensor's value) or
  makes a tensor whose shape depends on values (``nonzero``, a boolean index);
- it makes a tensor from host data (``torch.tensor`` inside the step: the graph keeps the data
  of its capture);
- a later call of the same shape traces differently: a Python number taken from anything but the
  shape (a row's length read on the host), or a tensor at another address (a table rebuilt);
- its first two runs disagree: the graph's warm-up and its replay both run the step (a step that
  updates its own inputs in place would count twice).

Like :class:`~d3d.backends.cuda.graphs.Graphs`, a shape's later calls return the first call's
output tensor, overwritten (a caller that kept the last step's output sees it change, as on a
GPU). The step runs for real each time, so the rehearsal decodes exactly what an eager step
does, or raises. It costs a Python call per operation: a test's instrument, chosen by
``graphs=True`` on a device without CUDA (:func:`runner_for`, which picks a step target's
runner: graphs, their rehearsal, or eager steps).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from d3d.backends.cuda.graphs import Eager, Graphs, Runner, Step, shape_key

# operations that read the device from the host or give a value-dependent shape
HOST_READS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select",
    "unique_consecutive", "unique_dim", "unique_dim_consecutive", "_unique", "_unique2",
})  # fmt: skip
HOST_DATA = frozenset({"lift_fresh", "lift_fresh_copy"})  # torch.tensor(...) inside the step


class GraphHazard(RuntimeError):
    """A step that a CUDA graph would replay wrongly or refuse to capture (module docstring)."""


class _Trace(TorchDispatchMode):
    """Each operation of one run: its name and arguments, tensors as the graph would see them."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.made: set[int] = set()  # storages this run made (intermediates, its output)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _composite(func.name()):
            with self:  # its parts, traced one by one: the kernels that run
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = func.__name__.split(".")[0]
        if name in HOST_READS or name in HOST_DATA:
            what = "makes a tensor from host data" if name in HOST_DATA else "reads the host"
            raise GraphHazard(f"the step {what} ({func}): a CUDA graph cannot hold it")
        flat, _ = tree_flatten((args, kwargs))
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat[1:]
        ):
            raise GraphHazard(f"a boolean index ({func}): its shape depends on the values")
        if func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise GraphHazard(f"{func} without output_size reads the host")
        seen = [self._seen(a) for a in flat]
        out = func(*args, **kwargs)
        ins = {_storage(a) for a in flat if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t) not in ins:
                self.made.add(_storage(t))
        self.ops.append((str(func), tuple(seen)))
        return out

    def _seen(self, a: Any) -> Any:
        """An argument as a graph holds it: a tensor this run made by its shape and dtype, one
        it did not make also by its address; a 0-d CPU tensor (a Python number) by its value."""
        if isinstance(a, torch.UntypedStorage):  # an address, like a tensor's
            ptr = a.data_ptr()
            return ("storage", a.nbytes()) if ptr in self.made else ("storage", ptr, a.nbytes())
        if not isinstance(a, torch.Tensor):
            return a if isinstance(a, int | float | bool | str | None) else repr(a)
        form = (tuple(a.shape), tuple(a.stride()), str(a.dtype))
        if _storage(a) in self.made:
            return ("made", *form)
        if a.dim() == 0 and a.device.type == "cpu":
            return ("number", a.item(), str(a.dtype))
        return ("read", _storage(a), a.storage_offset(), *form)


@functools.cache
def _composite(op: str) -> bool:
    """Whether ``op`` runs as other operations (no kernel of its own for a device)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(op, "CompositeImplicitAutograd") and not (has(op, "CPU") or has(op, "CUDA"))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _traced(step: Step, inputs: Any, n: int) -> tuple[torch.Tensor, list[tuple]]:
    with _Trace() as trace:
        out = step(inputs, n)
    return out, trace.ops


def _same(key: tuple, first: list[tuple], now: list[tuple]) -> None:
    """Raise :class:`GraphHazard` naming the first operation where ``now`` leaves ``first``."""
    for i, (a, b) in enumerate(zip(first, now, strict=False)):
        if a != b:
            raise GraphHazard(
                f"shape {key}: operation {i} differs from the captured one, so a replay would "
                f"compute something else: captured {a}, now {b}"
            )
    if len(first) != len(now):
        raise GraphHazard(f"shape {key}: {len(now)} operations, captured {len(first)}")


class Rehearsal:
    """Runs the step as a graph per shape would (module docstring); counts shapes as
    :class:`~d3d.backends.cuda.graphs.Graphs` does."""

    def __init__(self, step: Step):
        self.step = step
        self.graphs: dict[tuple, tuple[list[tuple], torch.Tensor]] = {}  # shape: trace, output

    @property
    def captured(self) -> int:
        return len(self.graphs)

    @property
    def shapes(self) -> int:
        return len(self.graphs)

    def run(self, inputs: Any, n: int) -> torch.Tensor:
        key = shape_key(inputs, n)
        if key not in self.graphs:
            first, trace = _traced(self.step, inputs, n)  # the warm-up
            out, again = _traced(self.step, inputs, n)  # the replay after the capture
            _same(key, trace, again)
            if not torch.equal(first, out):
                raise GraphHazard(
                    f"shape {key}: the step's second run differs from its first (a graph's "
                    "warm-up and replay both run it: does it change its own inputs?)"
                )
            self.graphs[key] = (trace, out)
            return out
        trace, out = self.graphs[key]
        now, again = _traced(self.step, inputs, n)
        _same(key, trace, again)
        return out.copy_(now)


def runner_for(step: Step, graphs: bool, device: torch.device) -> Runner:
    """The step's runner: graphs on a CUDA device, their rehearsal elsewhere, or eager steps."""
    if not graphs:
        return Eager(step)
    if torch.device(device).type == "cuda":
        return Graphs(step)
    return Rehearsal(step)
