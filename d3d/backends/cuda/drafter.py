"""The drafter on the cuda backend: its own slot KV, every row's blocks and branches in one
packed forward, captured per shape.

- **KV**: a :class:`~d3d.backends.cuda.kv.StaticKV` of the drafter's shape, allocated once: a
  row (a drafting session) holds one slot, its committed tokens (the drafter's own prompt and
  answer so far, plus the chain of drafts it read while the target verified them) at positions
  ``0 .. length - 1``. A step writes after each row's length: first its chain (kept: the row's
  length grows by it), then its blocks (scratch, overwritten by the next step, never kept).
  Cutting a row back (a commit that accepted less than the chain) only lowers its length. Live
  rows fill slots ``0 .. L-1`` (a row that leaves is replaced by the last), as the target's do.
- **Step** (:class:`~d3d.backends.cuda.drafter_step.PackedForward`): rows padded to a bucket
  of slots and their chains to W = 0 or Bk tokens; with nb blocks a row the shape is (bucket,
  W, nb), replayed from a CUDA graph per shape (:mod:`~d3d.backends.cuda.graphs`), whatever
  the context: the split attention kernel reads each query's bounds (where a sample proves it,
  :attr:`~d3d.backends.cuda.forward.StaticForward.reads_lengths`; else SDPA attends the first
  n keys and n, in a few sizes a doubling, is part of the shape). Anything else (a chain
  longer than a block: a prompt, a long catch-up; a row near its slot's end) runs the same
  step eagerly over just the step's rows.
- **Copies**: one host-to-device copy of the chains, lengths and slots per step; the blocks'
  anchors and visible lengths may already be on the device (the on-device branch choice,
  :func:`d3d.worker.branches.choose_rows`), written into the step's inputs there, or come from
  the host (a step of missed blocks), in that same copy. The caller takes the tokens back in
  one copy.

:func:`mark` is how the cuda backend tells the worker, through ``prepare_drafter``, to draft
this way (:func:`d3d.worker.workers.server_for` reads :func:`plan_of`).

Letters: R rows in a step, B slots bucket, T tokens a row, W chain width, nb blocks a row, Bk
block size, K = Bk-1, C a slot's capacity, n keys attended, V_d draft vocabulary, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from d3d.backends.cuda.drafter_step import PackedForward, PackedInputs
from d3d.backends.cuda.forward import attended
from d3d.backends.cuda.kv import SlotLimitError, StaticKV, static_shape
from d3d.backends.cuda.rehearsal import runner_for
from d3d.backends.cuda.target import BUCKETS
from d3d.backends.slabs import KvRow

ROWS = 32  # drafting sessions at once
KV_TOKENS = 1 << 16  # the drafter's KV budget (positions, all rows)
MARK = "d3d_packed_drafting"


@dataclass(frozen=True)
class PackedPlan:
    """How the worker drafts on this backend: ``graphs`` (False: the same step, eager)."""

    graphs: bool = True
    rows: int = ROWS
    kv_tokens: int = KV_TOKENS


def mark(lm: nn.Module, plan: PackedPlan) -> None:
    """Tell the worker to draft ``lm``'s drafter through :class:`PackedDrafter`."""
    setattr(lm, MARK, plan)


def plan_of(drafter: object) -> PackedPlan | None:
    """The plan :func:`mark` left on ``drafter``'s language model (None: draft row by row)."""
    return getattr(getattr(drafter, "lm", None), MARK, None)


@dataclass(frozen=True)
class Drafted:
    """A step's draft-space scores: ``blocks`` [R, nb, K, V_d]; ``last`` [R, V_d], each row's
    last chain token's (when asked for)."""

    blocks: torch.Tensor
    last: torch.Tensor | None


class PackedDrafter:
    """The drafter's slot KV and packed step (see the module docstring)."""

    def __init__(self, drafter, plan: PackedPlan | None = None):
        from d3d.backends.sizes import head_dim, kv_heads, window

        plan = plan or PackedPlan()
        self.drafter = drafter
        cfg = drafter.lm.config
        p = drafter.mask_embedding
        positions = window(cfg)
        slots, capacity = static_shape(plan.kv_tokens, plan.rows, positions)
        self.kv = StaticKV(
            cfg.num_hidden_layers, kv_heads(cfg), head_dim(cfg), p.dtype, p.device, slots, capacity
        )
        self.block = drafter.block_size
        self.step = PackedForward(drafter, self.kv)
        self.runner = runner_for(self.step, plan.graphs, p.device)
        self.buckets = tuple(sorted({b for b in BUCKETS if b < slots} | {slots}))
        self.inputs: dict[tuple[int, int, int], PackedInputs] = {}
        self.counts = {"packed": 0, "eager": 0}  # steps of each kind, for reports

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    # ----- rows -------------------------------------------------------------------------
    def open(self, need: int) -> KvRow:
        """A row for a session that will hold about ``need`` tokens (refused at once, naming
        the limit, where a slot cannot hold them or every slot is taken)."""
        self.kv.check(need)
        if len(self.kv.rows) >= self.kv.slots:
            raise SlotLimitError(need, self.kv.capacity, self.kv.slots)
        return self.kv.open(need)

    def close(self, row: KvRow) -> None:
        self.kv.close(row)

    def check_room(self, tokens: int, reserve: int) -> None:
        """Raise :class:`SlotLimitError` where a row of ``tokens`` tokens, and ``reserve``
        positions a step writes past them, would pass a slot's end (the row fails alone before
        the step: a step that raised would fail every row in it)."""
        if tokens + reserve > self.kv.capacity:
            raise SlotLimitError(tokens + reserve, self.kv.capacity, self.kv.slots)

    def reserve(self, branches: int) -> int:
        """Positions past a row's tokens one step may write with ``branches`` branches: a
        chain and a block per branch (and one more block)."""
        return (branches + 2) * self.block

    # ----- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        rows: Sequence[KvRow],
        chains: Sequence[Sequence[int]],
        visible: torch.Tensor,
        anchors: torch.Tensor,
        last: bool = False,
    ) -> Drafted:
        """One packed forward: row i appends ``chains[i]`` (kept) and drafts a block per column
        of ``visible`` / ``anchors`` [R, nb] (visible lengths, anchor target ids; host or
        device); ``last``: also score each row's last chain token (rows with a chain)."""
        r, nb, kb = len(rows), visible.shape[1], self.block
        longest = max((len(c) for c in chains), default=0)
        width = 0 if longest == 0 else -(-longest // kb) * kb
        t = width + nb * kb
        for row in rows:
            self.kv.ensure(row, row.length + t)  # a first write takes a slot
        live = self.kv.slab.rows
        bucket = next((b for b in self.buckets if b >= len(live)), None)
        captured = (
            width <= kb
            and bucket is not None
            and all(x.length + t <= self.kv.capacity for x in live)
        )
        if not captured:
            bucket = r
        at = [row.slot for row in rows] if captured else list(range(r))
        lengths = [0] * bucket
        for x in live if captured else ():
            lengths[x.slot] = x.length
        grid = [[0] * width for _ in range(bucket)]
        for i, (row, chain) in enumerate(zip(rows, chains, strict=True)):
            lengths[at[i]] = row.length
            grid[at[i]][: len(chain)] = chain
        ends = [at[i] * t + max(len(c), 1) - 1 for i, c in enumerate(chains)]
        # visible lengths and anchors given on the host travel in the step's one copy
        given = visible.device.type == "cpu" and nb > 0
        extra = [*visible.reshape(-1).tolist(), *anchors.reshape(-1).tolist()] if given else []
        host = torch.tensor([*(v for g in grid for v in g), *lengths, *at, *ends, *extra])
        dev = host.to(self.device, non_blocking=True)
        cut = [bucket * width, bucket, r, r, len(extra)]
        grid_d, lengths_d, at_d, ends_d, extra_d = dev.split(cut)
        if given:
            visible, anchors = extra_d.view(2, r, nb).unbind(0)
        x = self.inputs.get((bucket, t, nb))
        if x is None:
            x = self.inputs[(bucket, t, nb)] = PackedInputs.empty(bucket, t, nb, self.device)
        x.ids.zero_()
        x.ids.narrow(1, 0, width).copy_(grid_d.view(bucket, width))
        x.lengths.copy_(lengths_d)
        x.visible.zero_()
        if nb:
            x.visible.index_copy_(0, at_d, visible.to(self.device, torch.long))
            x.anchors(width, kb).index_copy_(0, at_d, anchors.to(self.device, torch.long))
        # keys attended: part of the shape only where SDPA reads the first n of them
        split = captured and self.step.core.reads_lengths
        n = self.kv.capacity if split else attended(max(lengths) + t, self.kv.capacity)
        if captured:
            self.counts["packed"] += 1
            hidden = self.runner.run(x, n)  # [B*T, H]
        else:
            self.counts["eager"] += 1
            slots = torch.tensor([row.slot for row in rows]).to(self.device, non_blocking=True)
            hidden = self.step(x, n, slots)
        for row, chain in zip(rows, chains, strict=True):
            self.kv.commit(row, len(chain))
        d = self.drafter
        offsets = torch.arange(nb, device=self.device)[:, None] * kb + torch.arange(
            kb - 1, device=self.device
        )  # [nb, K]
        where = at_d[:, None, None] * t + width + offsets  # [R, nb, K]
        blocks = d.head(hidden.index_select(0, where.reshape(-1)))
        blocks = blocks.view(r, nb, kb - 1, blocks.shape[-1])
        tail = d.head(hidden.index_select(0, ends_d)) if last else None
        return Drafted(blocks, tail)
