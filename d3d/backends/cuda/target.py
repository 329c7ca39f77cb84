"""The CUDA backend's step target: decode steps as replayed graphs, every other step eager.

A step is a *decode step* when every row in it has read its prompt into a slot and adds at most
K+1 tokens (plain rows 1, verifying rows an anchor and their drafts, a prompt's short last
chunk): its rows are padded to one width T (1, or K+1 when any row adds more than one), the
slots to a batch bucket B (1, 2, 4, 8, 16, 32, 64: the smallest that holds every live slot),
and the step runs as :class:`~d3d.backends.cuda.forward.StaticForward` over slots ``0 .. B-1``,
captured once per (B, T, n) as a CUDA graph (:mod:`d3d.backends.cuda.graphs`) — once per
(B, T) where its attention reads the rows' lengths (the split kernel): n is then the slot's
capacity, whatever the context, and :meth:`CudaTarget.capture` can take every graph up front.
A pad token's key lands after its row's length, where the next step writes anyway, and its
output is dropped; a slot whose row is not in the step (a prompt being read) is attended from
its own length and dropped the same way. Any other step (a prompt's chunk, a row with more
than K+1 tokens, a row near its slot's end) runs the slab KV's eager ragged forward,
:class:`~d3d.backends.target.BatchTarget`'s, over the same KV.

The host builds the step's ids and lengths as one small copy in, and the logits of the kept
positions come back from the LM head run over those positions only; the step is timed with
CUDA events (read when the caller asks, after its own copy of the accepted tokens has waited
for the stream), never by synchronising the device.

Letters: B rows (slots), T tokens a row, n keys attended, C a slot's capacity, M kept positions,
V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from d3d.backends.clock import WALL, Clock
from d3d.backends.cuda.forward import StaticForward, StepInputs, attended
from d3d.backends.cuda.kv import StaticKV
from d3d.backends.cuda.rehearsal import runner_for
from d3d.backends.slabs import KvRow
from d3d.backends.target import BatchTarget, kept_positions

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class CudaTarget(BatchTarget):
    """See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        kv: StaticKV,
        clock: Clock = WALL,
        block: int = 16,
        graphs: bool = True,
        fused: bool = True,
        kernels: bool = True,
    ):
        super().__init__(model, kv, clock)
        self.kv: StaticKV = kv
        self.widths = (1, block)
        self.buckets = tuple(sorted({b for b in BUCKETS if b < kv.slots} | {kv.slots}))
        self.step = StaticForward(model, kv.keys, kv.values, fused, kernels)
        self.runner = runner_for(self.step, graphs, self.device)
        self.inputs: dict[tuple[int, int], StepInputs] = {}
        self.counts = {"decode": 0, "eager": 0}  # steps of each kind, for reports
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._seconds = 0.0

    @property
    def last_seconds(self) -> float:
        """The last forward's time (CUDA events on a GPU: read once its work has ended)."""
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            self._seconds, self._events = start.elapsed_time(end) / 1e3, None
        return self._seconds

    @last_seconds.setter
    def last_seconds(self, value: float) -> None:
        self._seconds, self._events = value, None

    @torch.inference_mode()
    def forward(
        self,
        rows: Sequence[KvRow],
        ids: Sequence[Sequence[int]],
        keep: Sequence[Sequence[int] | None] | None = None,
    ) -> list[torch.Tensor]:
        plan = self._plan(rows, ids)
        if plan is None:
            self.counts["eager"] += 1
            return super().forward(rows, ids, keep)
        self.counts["decode"] += 1
        width, bucket = plan
        timed = self.device.type == "cuda"
        if timed:  # on this device's stream, whichever device is the thread's current one
            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        else:
            t0 = self.clock.now()
        live = [r.length for r in self.kv.slab.rows]  # every slot's, in the step or not
        lengths = live + [0] * (bucket - len(live))
        grid = [[0] * width for _ in range(bucket)]
        wanted = kept_positions(ids, keep)
        flat: list[int] = []
        for row, r, w in zip(rows, ids, wanted, strict=True):
            grid[row.slot][: len(r)] = r
            flat += [row.slot * width + t for t in w]
        x = self._inputs(bucket, width)
        host = torch.tensor([*(t for g in grid for t in g), *lengths, *flat])
        dev = host.to(self.device, non_blocking=True)
        x.fill(
            dev[: bucket * width].view(bucket, width), dev[bucket * width : bucket * (width + 1)]
        )
        # keys attended: part of the step's shape only where SDPA reads the first n of them
        most = max(lengths) + width
        n = self.kv.capacity if self.step.reads_lengths else attended(most, self.kv.capacity)
        hidden = self.runner.run(x, n)  # [B*T, H]
        kept = dev[bucket * (width + 1) :]
        logits = self.step.head(hidden.index_select(0, kept))  # [M, V]
        self.last_logits = logits
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._events = (start, end)
        else:
            self.last_seconds = self.clock.now() - t0
        return list(logits.split([len(w) for w in wanted]))

    @torch.inference_mode()
    def capture(self) -> int:
        """Every decode step's graph now — each rows bucket, plain and verify width — where one
        graph per (B, T) serves every context (the step reads the rows' lengths) and no row is
        open (each step writes its keys from position 0 of slots 0 .. B-1, positions no row
        holds). How many shapes it met for the first time (0: n is part of the shape here, or
        rows are open: graphs are then captured on first use, as always)."""
        if not self.step.reads_lengths or self.kv.slab.rows:
            return 0
        before = self.runner.shapes
        for bucket in self.buckets:
            for width in self.widths:
                x = self._inputs(bucket, width)
                x.fill(x.ids.new_zeros(bucket, width), x.lengths.new_zeros(bucket))
                self.runner.run(x, self.kv.capacity)
        return self.runner.shapes - before

    def _inputs(self, bucket: int, width: int) -> StepInputs:
        """The (B, T) step's inputs, at the addresses its graph reads (made on first use)."""
        x = self.inputs.get((bucket, width))
        if x is None:
            x = self.inputs[(bucket, width)] = StepInputs.empty(bucket, width, self.device)
        return x

    def _plan(self, rows: Sequence[KvRow], ids: Sequence[Sequence[int]]) -> tuple[int, int] | None:
        """(T, B) of a decode step, or None for a step that runs eagerly (module docstring)."""
        if not rows:
            return None
        longest = max(len(r) for r in ids)
        width = next((w for w in self.widths if longest <= w), None)
        if width is None or min(len(r) for r in ids) < 1:
            return None
        slab = self.kv.slab
        if any(r.slab is not slab for r in rows):
            return None  # a row reads its prompt's first chunk: no slot yet
        live = len(slab.rows)
        bucket = next((b for b in self.buckets if b >= live), None)
        if bucket is None or any(r.length + width > self.kv.capacity for r in slab.rows):
            return None
        return width, bucket
