"""The drafter training loop: AdamW over the drafter's own weights, resumable, data-parallel.

Design:

- The drafter starts from a pretrained causal LM with the target's tokenizer (:mod:`.init`):
  some of the target's own layers, another pretrained model (``--init``), or a checkpoint. What
  trains is :meth:`D3DDrafter.trainable_parameters`; everything else is frozen here, so no
  gradient is ever computed for a vocabulary-sized matrix.
- One *step* = ``grad_accum`` sequences (the global batch), each one packed forward
  (:mod:`.objectives`); AdamW with linear warm-up then cosine decay to 10%, gradient clipping.
  Under torchrun the sequences of a step are spread over the ranks (:mod:`.parallel`: DDP, or
  FSDP for a drafter too big for one device); the step is the same at any world size.
- Precision: fp32 on the CPU; on CUDA the trainable weights stay fp32 (master weights) and the
  forward runs under bf16 autocast (the frozen tensors stay in the target's dtype).
- ``grad_checkpointing``: each decoder layer's activations are recomputed in the backward pass
  instead of kept (transformers' non-reentrant checkpointing), for long windows and big
  drafters. Not for adapter drafters: their gradient pass reads a KV cache of the clean pass,
  which a checkpointed layer would drop.
- Everything a resume needs lives in ``OUT/last``: the drafter checkpoint plus ``trainer.pt``
  (optimizer, scheduler, step), as whole tensors whatever the world size. The data order and the
  anchors are functions of (seed, sequence index), so a resumed run — with another number of
  processes too — sees exactly the sequences it would have seen. ``keep_every`` also keeps
  ``OUT/step_K`` copies. ``OUT/log.jsonl`` gets one line per step and per validation
  (:mod:`.curves`); ``OUT/final`` is the finished drafter. Rank 0 writes; the others wait.
- Validation is the offline acceptance length (:mod:`.accept`, stride mode) on sequences set
  aside from the training split — the held-out split stays untouched for the final report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from d3d.model.drafter import WEIGHTS_FILE, D3DDrafter
from d3d.training.accept import offline_acceptance
from d3d.training.curves import plot_log
from d3d.training.data import MIN_RESPONSE_TOKENS
from d3d.training.objectives import LossConfig, LossParts, Packed, pack
from d3d.training.parallel import STRATEGIES, Dist, Replicas

log = logging.getLogger(__name__)

TRAINER_FILE = "trainer.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one training run (``grad_accum``: sequences per step, over all
    processes)."""

    steps: int = 300
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.0
    grad_accum: int = 4
    grad_clip: float = 1.0
    max_len: int = 320
    loss: LossConfig = field(default_factory=LossConfig)
    val_every: int = 50
    val_stride: int = 4
    save_every: int = 25
    seed: int = 0
    grad_checkpointing: bool = False
    parallel: str = "ddp"  # under torchrun: ddp, or fsdp (sharded layers)
    keep_every: int = 0  # also keep OUT/step_K every K steps (0: only OUT/last)

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "val_every", "save_every", "val_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.max_len < 8:
            raise ValueError(f"max_len: must be >= 8, got {self.max_len}")
        if self.parallel not in STRATEGIES:
            raise ValueError(f"parallel: use one of {', '.join(STRATEGIES)}, got {self.parallel}")
        if self.keep_every < 0:
            raise ValueError(f"keep_every: must be >= 0, got {self.keep_every}")


@dataclass
class TrainResult:
    """What a run did: steps done, the last logged losses and validation acceptance lengths."""

    steps: int
    loss: float
    val: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def save_compact(drafter: D3DDrafter, path: str | Path, dtype: torch.dtype) -> Path:
    """Save ``drafter`` with its own tensors in ``dtype`` (e.g. float16 halves a shipped
    checkpoint; loading casts back to the target's dtype)."""
    return drafter.save(path, dtype)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine to 0.1 at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / span)))


def trainable(drafter: D3DDrafter) -> list[torch.nn.Parameter]:
    """What a run updates (see :meth:`D3DDrafter.trainable_parameters`)."""
    return drafter.trainable_parameters()


def sequence_order(n: int, index: int, seed: int) -> int:
    """The record used as the ``index``-th training sequence: a fresh permutation per epoch."""
    epoch, i = divmod(index, n)
    return _permutation(n, seed, epoch)[i]


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def usable(records: Sequence[dict]) -> list[dict]:
    """Records with something to train on (two response tokens or more): every one of them
    packs, so every rank runs every micro-step it is given."""
    return [r for r in records if len(r["response_ids"]) >= MIN_RESPONSE_TOKENS]


def packed_sequence(rec: dict, index: int, block_size: int, cfg: TrainConfig) -> Packed:
    """The ``index``-th training sequence laid out (anchors from a generator seeded by index)."""
    g = torch.Generator().manual_seed(cfg.seed * 7_919 + index)
    topk = (
        (rec["topk_ids"], rec["topk_logprobs"])
        if cfg.loss.kl_weight and "topk_ids" in rec
        else None
    )
    packed = pack(rec["prompt_ids"], rec["response_ids"], cfg.loss.anchors_per_seq, block_size,
                  g, cfg.max_len, topk)  # fmt: skip
    assert packed is not None, "usable() keeps only records that pack"
    if rec.get("teacher_forced"):
        packed = dataclasses.replace(packed, teacher_forced=True)
    return packed


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _accumulate(
    rep: Replicas, records: Sequence[dict], cfg: TrainConfig, step: int
) -> list[LossParts]:
    """Forward and backward over this rank's sequences of one step (sequence i = step x G + a
    for a = rank, rank + W, ...; deterministic in seed and i, whatever the world size)."""
    d, drafter = rep.dist, rep.drafter
    mine = list(range(d.rank, cfg.grad_accum, d.world))
    scale = d.world / cfg.grad_accum  # the all-reduce averages over ranks: sum / G in all
    parts = []
    for j, a in enumerate(mine):
        index = step * cfg.grad_accum + a
        rec = records[sequence_order(len(records), index, cfg.seed)]
        packed = packed_sequence(rec, index, drafter.block_size, cfg)
        with rep.accumulate(last=j == len(mine) - 1):
            with _autocast(drafter.device):
                lp = rep.loss(packed)
            (lp.total * scale).backward()
        parts.append(lp)
    return parts


def _log_row(step: int, parts: list[LossParts], lr: float, seconds: float, d: Dist) -> dict:
    ntp = [p.ntp for p in parts if not math.isnan(p.ntp)]
    total, block, n, ntp_sum, n_ntp = d.sum(
        [sum(float(p.total.detach()) for p in parts), sum(p.block for p in parts), len(parts),
         sum(ntp), len(ntp)]
    )  # fmt: skip
    return {
        "step": step,
        "loss": round(total / n, 4),
        "block": round(block / n, 4),
        "ntp": round(ntp_sum / n_ntp, 4) if n_ntp else None,
        "lr": lr,
        "seconds": round(seconds, 1),
    }


def prepare(drafter: D3DDrafter, cfg: TrainConfig) -> list[torch.nn.Parameter]:
    """Freeze all but what trains (fp32 master weights on CUDA); gradient checkpointing."""
    params = trainable(drafter)
    drafter.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
        if drafter.device.type == "cuda":
            p.data = p.data.float()
    if cfg.grad_checkpointing:
        if drafter.adapters is not None:
            raise ValueError(
                "grad_checkpointing: an adapter drafter's gradient pass reads a KV cache, which "
                "checkpointed layers drop; train it without"
            )
        checkpointing(drafter.lm, True)
    return params


def checkpointing(lm, on: bool) -> None:
    """Each decoder layer's activations recomputed in the backward pass, or kept (transformers
    5 calls it activation checkpointing, 4.x gradient checkpointing)."""
    kind = "activation" if hasattr(lm, "activation_checkpointing_enable") else "gradient"
    if on:
        getattr(lm, f"{kind}_checkpointing_enable")({"use_reentrant": False})
    else:
        getattr(lm, f"{kind}_checkpointing_disable")()


def save_state(rep: Replicas, opt, sched, step: int, out: Path) -> None:
    """Write the drafter and trainer state to ``out`` atomically (via a side folder), whole
    tensors, from rank 0 (a sharded run gathers on every rank first)."""
    tensors, optim = rep.model_state(), rep.optim_state(opt)
    if rep.dist.main:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        from d3d.model.checkpoint import save_drafter

        save_drafter(rep.drafter, tmp, tensors=tensors)
        torch.save({"step": step, "opt": optim, "sched": sched.state_dict()}, tmp / TRAINER_FILE)
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
    rep.dist.barrier()


def _resume_weights(drafter: D3DDrafter, last: Path) -> dict:
    """Load ``last``'s weights into the drafter (before any sharding); its trainer state."""
    state = torch.load(last / TRAINER_FILE, map_location="cpu", weights_only=True)
    weights = load_file(str(last / WEIGHTS_FILE), device=str(drafter.device))
    _, unexpected = drafter.load_state_dict(weights, strict=False)
    if unexpected:
        raise ValueError(f"{last} does not fit this drafter: {unexpected[:3]}")
    return state


def train(
    drafter: D3DDrafter,
    records: Sequence[dict],
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    val_records: Sequence[dict] = (),
    resume: bool = True,
    progress: bool = True,
    on_val: Callable[[int, dict], None] | None = None,
    dist: Dist | None = None,
) -> TrainResult:
    """Train ``drafter`` in place on records with ``prompt_ids`` / ``response_ids``.

    With ``out_dir``: checkpoints to ``out_dir/last`` every ``save_every`` steps, resumes from
    it when present (and ``resume``), logs to ``out_dir/log.jsonl``, and saves ``out_dir/final``.
    ``dist``: this process's rank under torchrun (default: one process). After a sharded run
    the drafter's layers stay sharded: read the result from ``out_dir/final``.
    """
    d = dist or Dist()
    records = usable(records)
    if not records:
        raise ValueError("no training records (each needs two response tokens or more)")
    if cfg.grad_accum % d.world:
        raise ValueError(
            f"grad_accum: the global batch ({cfg.grad_accum} sequences a step) must be a "
            f"multiple of the number of processes ({d.world})"
        )
    out = Path(out_dir) if out_dir is not None else None
    prepare(drafter, cfg)
    state = None
    if out is not None and resume and (out / "last" / TRAINER_FILE).is_file():
        state = _resume_weights(drafter, out / "last")
    rep = Replicas(drafter, cfg.loss, d, cfg.parallel)
    opt = torch.optim.AdamW(rep.params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                            foreach=rep.foreach)  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    start = 0
    if state is not None:
        rep.load_optim_state(opt, state["opt"])
        sched.load_state_dict(state["sched"])
        start = int(state["step"])
        log.info("resuming from step %d", start)
    main = d.main and out is not None
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({**asdict(cfg), "world": d.world}, indent=2))
    logf = (out / "log.jsonl").open("a") if main else None

    result = TrainResult(steps=start, loss=math.nan)
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=start, desc="train", disable=not (progress and d.main))
    try:
        for step in range(start, cfg.steps):
            drafter.train()
            opt.zero_grad(set_to_none=True)
            parts = _accumulate(rep, records, cfg, step)
            rep.reduce()
            rep.clip(cfg.grad_clip)
            opt.step()
            sched.step()
            result.steps = step + 1
            row = _log_row(step + 1, parts, sched.get_last_lr()[0], time.perf_counter() - t0, d)
            result.loss = row["loss"]
            bar.set_postfix(loss=f"{row['loss']:.3f}", block=f"{row['block']:.3f}")
            if logf:
                logf.write(json.dumps(row) + "\n")
                logf.flush()
            bar.update(1)
            last = step + 1 == cfg.steps
            if out is not None and ((step + 1) % cfg.save_every == 0 or last):
                save_state(rep, opt, sched, step + 1, out / "last")
                if cfg.keep_every and (step + 1) % cfg.keep_every == 0 and d.main:
                    shutil.copytree(out / "last", out / f"step_{step + 1}", dirs_exist_ok=True)
            if val_records and ((step + 1) % cfg.val_every == 0 or last):
                drafter.eval()  # every rank: a sharded drafter's layers gather in each forward
                acc = offline_acceptance(drafter, val_records, mode="stride", stride=cfg.val_stride)
                vrow = {"step": step + 1, "val_acceptance_length": round(acc.acceptance_length, 4)}
                result.val.append(vrow)
                log.info("step %d: validation acceptance length %.3f", step + 1, vrow[
                    "val_acceptance_length"])  # fmt: skip
                if logf:
                    logf.write(json.dumps(vrow) + "\n")
                if on_val:
                    on_val(step + 1, vrow)
    finally:
        bar.close()
        if logf:
            logf.close()
    drafter.eval()
    for p in rep.params:
        p.requires_grad_(False)
    if cfg.grad_checkpointing:
        checkpointing(drafter.lm, False)
    if out is not None:
        final = rep.model_state()
        if d.main:
            from d3d.model.checkpoint import save_drafter

            save_drafter(drafter, out / "final", tensors=final)
            plot_log(out / "log.jsonl", out / "curve.png")
        d.barrier()
    result.seconds = time.perf_counter() - t0
    return result
