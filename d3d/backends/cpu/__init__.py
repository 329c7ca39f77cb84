"""The CPU backend: every CPU tuning of the target, behind the backend seam.

At load (:meth:`CpuBackend.prepare`) the target gets, where each fits and a sample agrees:

- the heap settings that keep freed activation memory (:mod:`~d3d.backends.cpu.heap`);
- float32 linear maps prepacked for oneDNN (:mod:`~d3d.backends.cpu.packing`, through vLLM's
  handler and a primitive for each thread budget, :mod:`~d3d.backends.cpu.onednn`, where vLLM's
  CPU build is installed);
- vLLM's one-pass RMSNorm and rotary kernels and its paged CPU attention
  (:mod:`~d3d.backends.cpu.fused`, :mod:`~d3d.backends.cpu.attention`);
- a lean forward in those kernels (:mod:`~d3d.backends.cpu.lean`).

Its step target (:meth:`CpuBackend.target`) keeps keys transposed where vLLM's kernel attends
(the kernel writes them), attends groups through :func:`~d3d.backends.cpu.groups.attend_group`,
faults in a burst's KV memory ahead of time, and runs the lean forward once the whole step
agreed with the reference on a sample (:mod:`d3d.backends.check`); where it does not, the
reference runs and the log says so. ``pack=False`` / ``fuse=False`` (``--no-pack``,
``--no-fuse``) leave those parts out.
"""

from __future__ import annotations

import functools
import logging
import weakref

from torch import nn

from d3d.backends import check
from d3d.backends.clock import WALL, Clock
from d3d.backends.cpu import attention, groups, heap, lean
from d3d.backends.cpu.fused import fuse
from d3d.backends.cpu.packing import pack_linears
from d3d.backends.kv import KvHooks, RowKV
from d3d.backends.reference import ReferenceBackend
from d3d.backends.target import BatchTarget

log = logging.getLogger(__name__)

# per model: (whether it had a lean forward when checked, the verdict)
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, tuple[bool, bool]] = weakref.WeakKeyDictionary()


class CpuBackend(ReferenceBackend):
    """See the module docstring."""

    name = "cpu"

    def __init__(self, pack: bool = True, fuse: bool = True):
        self.pack, self.fuse = pack, fuse

    def prepare(self, model: nn.Module) -> None:
        heap.keep_freed_memory()  # large activations reuse pages
        if self.pack:  # with vLLM's matmul handler where its kernels are wanted and installed
            pack_linears(model, vllm=self.fuse)
        if self.fuse:
            fuse(model)  # vLLM's one-pass norm, rotary and paged attention kernels
            lean.attach(model)  # and a forward of its own in them

    def prepare_drafter(self, model: nn.Module) -> None:
        if self.pack:
            pack_linears(model)

    def target(
        self,
        model: nn.Module,
        max_kv_tokens: int,
        clock: Clock = WALL,
        rows: int = 32,
        block: int = 16,
    ) -> BatchTarget:
        if not self._agrees(model):
            return super().target(model, max_kv_tokens, clock)
        return self._target(model, max_kv_tokens, clock)

    def _target(self, model: nn.Module, max_kv_tokens: int, clock: Clock = WALL) -> BatchTarget:
        isa = attention.paged_attention(model)  # keys kept as vLLM's kernel reads them
        hooks = KvHooks(
            attend=groups.attend_group,
            write=None if isa is None else functools.partial(attention.write, isa=isa),
            pretouch=heap.pretouch,
        )
        kv = RowKV.for_model(model, max_kv_tokens, keys_t=isa is not None, hooks=hooks)
        return BatchTarget(model, kv, clock, fast=lean.of(model))

    def _agrees(self, model: nn.Module) -> bool:
        """The whole CPU step against the reference on a sample, once per model; a lean
        forward that disagrees is dropped and the rest checked again."""
        had = lean.of(model) is not None
        if _VERDICTS.get(model, (None,))[0] != had:
            ok = check.sample_agrees(model, check.steps_of(self._target(model, 256)), self.name)
            if not ok and lean.of(model) is not None:
                log.warning("the lean forward disagrees with %s's own; it runs its own",
                            type(model).__name__)  # fmt: skip
                lean.detach(model)
                ok = check.sample_agrees(model, check.steps_of(self._target(model, 256)), self.name)
            _VERDICTS[model] = (lean.of(model) is not None, ok)
        return _VERDICTS[model][1]


__all__ = ["CpuBackend"]
