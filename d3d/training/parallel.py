"""Data-parallel training: one process per device under torchrun, DDP or FSDP, any world size.

Design:

- ``torchrun --nproc_per_node N -m d3d train ...`` starts N copies of the command; each reads
  ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (:func:`start`), joins one process group (NCCL on
  CUDA, gloo on the CPU) and trains on ``cuda:LOCAL_RANK``. Without torchrun nothing changes.
- A step's *global* batch is ``grad_accum`` sequences. Sequence i = step x G + a goes to rank
  a mod W; which record it is and which anchors it gets depend on (seed, i) only, so a run
  makes the same steps at any world size (up to float summation order), and a resumed run may
  change W (G must be a multiple of W).
- Each rank back-propagates loss x W / G per sequence; the gradient all-reduce averages over
  ranks, which gives the single-process sum / G.
- ``ddp``: torch's DistributedDataParallel around a module whose forward is the loss (DDP hooks
  the forward; the drafter's own entry points are ``body``/``head``), micro-steps under
  ``no_sync`` but the last; frozen tensors (the target's embeddings) stay out of its broadcasts.
- ``fsdp`` (a drafter that does not fit one device with its optimizer state): FSDP2
  ``fully_shard`` on each decoder layer, where nearly all parameters are — their weights,
  gradients and AdamW state live in shards. What else trains (mask embedding, final norm) is
  small, replicated, and all-reduced by hand; the frozen vocabulary-sized matrices are
  replicated. Layers all-gather their weights for each forward, so any forward works on every
  rank at once (validation runs everywhere, identically).
- State on disk is always whole tensors in the single-process layout (the drafter's state dict;
  the optimizer's state dict indexed like ``trainable(drafter)``), written by rank 0, so either
  strategy at any world size resumes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from d3d.model.drafter import D3DDrafter
from d3d.model.meta import layer_stack
from d3d.training.objectives import LossConfig, LossParts, Packed, drafter_loss

log = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: rank ``rank`` of ``world`` (one process: 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum over ranks (float64, on the CPU: gloo; NCCL needs the device)."""
        if not self.enabled:
            return list(values)
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        return t.tolist()


def from_env() -> Dist:
    """The ranks torchrun set (one process when it did not)."""
    env = os.environ
    return Dist(
        int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
    )


def start(device: str) -> tuple[Dist, str]:
    """Join the process group torchrun describes (if any); returns this rank and its device
    (``cuda`` becomes ``cuda:LOCAL_RANK``)."""
    d = from_env()
    if d.enabled and device.startswith("cuda"):
        device = f"cuda:{d.local_rank}"
        torch.cuda.set_device(d.local_rank)
    if d.enabled and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return d, device


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class LossModule(nn.Module):
    """The training loss as a module's forward, so DDP can wrap it."""

    def __init__(self, drafter: D3DDrafter, cfg: LossConfig):
        super().__init__()
        self.drafter, self.cfg = drafter, cfg

    def forward(self, packed: Packed) -> LossParts:
        return drafter_loss(self.drafter, packed, self.cfg)


class Replicas:
    """How the drafter's gradients meet across processes (see the module docstring)."""

    def __init__(self, drafter: D3DDrafter, cfg: LossConfig, d: Dist, strategy: str = "ddp"):
        if strategy not in STRATEGIES:
            raise ValueError(f"parallel: use one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.drafter, self.cfg, self.dist = drafter, cfg, d
        self.strategy = strategy if d.enabled else "single"
        self.ddp: nn.Module | None = None
        self.sharded: list[nn.Module] = []
        if self.strategy == "ddp":
            self.ddp = _ddp(LossModule(drafter, cfg))
        elif self.strategy == "fsdp":
            if drafter.adapters is not None:
                raise ValueError(
                    "parallel: fsdp shards a drafter's own layers; an adapter drafter's layers "
                    "are frozen and shared: use ddp"
                )
            from torch.distributed.fsdp import fully_shard

            self.sharded = list(layer_stack(drafter.lm))
            for layer in self.sharded:
                fully_shard(layer)
        self.params = drafter.trainable_parameters()  # after sharding: the sharded ones
        self.replicated = [p for p in self.params if not _is_dtensor(p)]

    @property
    def foreach(self) -> bool | None:
        """AdamW's foreach kernels cannot mix sharded and whole tensors."""
        return False if self.sharded else None

    def loss(self, packed: Packed) -> LossParts:
        if self.ddp is not None:
            return self.ddp(packed)
        return drafter_loss(self.drafter, packed, self.cfg)

    @contextlib.contextmanager
    def accumulate(self, last: bool) -> Iterator[None]:
        """A micro-step's backward; gradients are reduced only on the step's ``last`` one."""
        if self.ddp is not None and not last:
            with self.ddp.no_sync():
                yield
            return
        for layer in self.sharded:
            layer.set_requires_gradient_sync(last)
        yield

    def reduce(self) -> None:
        """Average the replicated gradients of a sharded run (DDP and FSDP do their own)."""
        if self.strategy != "fsdp":
            return
        for p in self.replicated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(self.dist.world)

    def clip(self, max_norm: float) -> float:
        """Clip the gradients' global norm to ``max_norm`` (as ``clip_grad_norm_``); the norm."""
        if self.strategy != "fsdp":
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        local = torch.zeros((), dtype=torch.float64, device=self.drafter.device)
        whole = torch.zeros_like(local)
        for p in self.params:
            if p.grad is None:
                continue
            if _is_dtensor(p.grad):
                local += p.grad.to_local().double().square().sum()
            else:
                whole += p.grad.double().square().sum()
        dist.all_reduce(local)  # every rank's shard; the replicated part is the same everywhere
        norm = float((local + whole).sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    # ----- whole tensors, for checkpoints --------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor] | None:
        """The drafter's state dict as whole tensors (None: its own tensors are whole).
        Sharded runs gather, so every rank must call this."""
        if self.strategy != "fsdp":
            return None
        return {k: _whole(v) for k, v in self.drafter.state_dict().items()}

    def optim_state(self, opt: torch.optim.Optimizer) -> dict:
        """The optimizer's state dict with whole tensors (every rank must call this)."""
        state = opt.state_dict()
        if self.strategy != "fsdp":
            return state
        return {
            "state": {i: {k: _whole(v) for k, v in s.items()} for i, s in state["state"].items()},
            "param_groups": state["param_groups"],
        }

    def load_optim_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        """Load a whole-tensor optimizer state (from any world size) into this run's shards."""
        if self.strategy == "fsdp":
            from torch.distributed.tensor import distribute_tensor

            out = {}
            for i, s in state["state"].items():
                p = self.params[int(i)]
                out[i] = {
                    k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                    if _is_dtensor(p) and torch.is_tensor(v) and v.shape == p.shape
                    else v
                    for k, v in s.items()
                }
            state = {"state": out, "param_groups": state["param_groups"]}
        opt.load_state_dict(state)


def _ddp(module: LossModule) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Frozen tensors and buffers (rotary frequencies, draft-vocabulary rows) are the same on
    # every rank: never broadcast (at init or per forward), never reduced.
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    frozen += [n for n, _ in module.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(module, frozen)
    return DDP(module, device_ids=None)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _is_dtensor(t) else t
