"""The drafter training loop: AdamW over the drafter's own weights, resumable.

Design:

- The drafter starts from a pretrained causal LM with the target's tokenizer — by default some of
  the target's own layers (``self:N`` / ``self:i,j,k``), or any checkpoint directory. The shared
  embeddings and LM head stay frozen (they are the target's); the drafter's layers, final norm
  and mask embedding train. ``lora:N[:RANK]`` starts a gated-adapter drafter instead: the
  target's first N layers stay frozen (shared, not copied) and only the adapters and the mask
  embedding train (:meth:`D3DDrafter.trainable_parameters`); a checkpoint of it holds just those.
- One *step* = ``grad_accum`` sequences, each one packed forward (:mod:`.objectives`); AdamW
  with linear warm-up then cosine decay to 10%, gradient clipping.
- Precision: fp32 on CPU; on CUDA the trainable weights stay fp32 and the forward runs under
  bf16 autocast (the frozen shared tensors stay in the target's dtype).
- Everything a resume needs lives in ``OUT/last``: the drafter checkpoint plus ``trainer.pt``
  (optimizer, scheduler, step). The data order and the anchors are functions of (seed, step),
  so a resumed run sees exactly the sequences it would have seen. ``OUT/log.jsonl`` gets one
  line per step and per validation; ``OUT/final`` is the finished drafter.
- Validation is the offline acceptance length (:mod:`.accept`, stride mode) on sequences set
  aside from the training split — the held-out split stays untouched for the final report.
- ``OUT/curve.png`` plots the log (training loss, moving average, and validation acceptance
  length against the step) at the end of a run; a resumed run's repeated steps count once.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from transformers import AutoModelForCausalLM

from d3d.model.adapters import AdapterConfig
from d3d.model.drafter import WEIGHTS_FILE, D3DDrafter, DrafterMeta
from d3d.training.accept import offline_acceptance
from d3d.training.objectives import LossConfig, LossParts, drafter_loss, pack

log = logging.getLogger(__name__)

TRAINER_FILE = "trainer.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one training run."""

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

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "val_every", "save_every", "val_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.max_len < 8:
            raise ValueError(f"max_len: must be >= 8, got {self.max_len}")


@dataclass
class TrainResult:
    """What a run did: steps done, the last logged losses and validation acceptance lengths."""

    steps: int
    loss: float
    val: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def init_drafter(spec: str, target, device: str | torch.device | None = None) -> D3DDrafter:
    """The drafter a run starts from: ``hf:ID_OR_DIR`` (a whole pretrained causal LM with the
    target's tokenizer, e.g. ``hf:Qwen/Qwen3-1.7B`` for a Qwen3-8B target; its own embeddings are
    kept and frozen), else any spec :func:`d3d.engine.build_drafter` takes (``self:N``, ...)."""
    from d3d.engine import build_drafter

    if spec.startswith("lora:"):
        parts = spec.split(":")
        try:
            n, rank = int(parts[1]), int(parts[2]) if len(parts) > 2 else 16
        except (IndexError, ValueError) as exc:
            raise ValueError(f"bad drafter spec {spec!r}: use lora:N or lora:N:RANK") from exc
        cfg = AdapterConfig(rank=rank, alpha=2.0 * rank)
        return D3DDrafter.from_target(target.model, n, base=target.spec, device=device,
                                      adapter=cfg)  # fmt: skip
    if not spec.startswith("hf:"):
        return build_drafter(spec, target, device)
    lm = AutoModelForCausalLM.from_pretrained(
        spec[len("hf:") :], dtype=target.model.dtype, attn_implementation="sdpa"
    )
    vocab = int(lm.get_output_embeddings().weight.shape[0])
    if vocab != target.vocab_size:
        raise ValueError(
            f"{spec}: vocabulary {vocab} differs from the target's {target.vocab_size}; "
            "a drafter must share the target's tokenizer"
        )
    n = int(lm.config.num_hidden_layers)
    meta = DrafterMeta(
        base=spec[3:], layers=tuple(range(n)), shared_embeddings=False, vocab_size=vocab
    )
    return D3DDrafter(lm, meta).to(device or target.device)


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
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return int(torch.randperm(n, generator=g)[i])


def save_state(drafter: D3DDrafter, opt, sched, step: int, out: Path) -> None:
    """Write the drafter and trainer state to ``out`` atomically (via a side folder)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp)
    torch.save(
        {"step": step, "opt": opt.state_dict(), "sched": sched.state_dict()}, tmp / TRAINER_FILE
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _accumulate(
    drafter: D3DDrafter, records: Sequence[dict], cfg: TrainConfig, step: int
) -> list[LossParts]:
    """Forward and backward over the ``grad_accum`` sequences of one step (deterministic in
    seed and step, so a resumed run sees the same data)."""
    parts = []
    for a in range(cfg.grad_accum):
        index = step * cfg.grad_accum + a
        rec = records[sequence_order(len(records), index, cfg.seed)]
        g = torch.Generator().manual_seed(cfg.seed * 7_919 + index)
        topk = (
            (rec["topk_ids"], rec["topk_logprobs"])
            if cfg.loss.kl_weight and "topk_ids" in rec
            else None
        )
        packed = pack(rec["prompt_ids"], rec["response_ids"], cfg.loss.anchors_per_seq,
                      drafter.block_size, g, cfg.max_len, topk)  # fmt: skip
        if packed is None:
            continue
        if rec.get("teacher_forced"):
            packed = dataclasses.replace(packed, teacher_forced=True)
        with _autocast(drafter.device):
            lp = drafter_loss(drafter, packed, cfg.loss)
        (lp.total / cfg.grad_accum).backward()
        parts.append(lp)
    return parts


def _log_row(step: int, parts: list[LossParts], lr: float, seconds: float) -> dict:
    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 4)

    ntp = [p.ntp for p in parts if not math.isnan(p.ntp)]
    return {
        "step": step,
        "loss": mean([float(p.total.detach()) for p in parts]),
        "block": mean([p.block for p in parts]),
        "ntp": mean(ntp) if ntp else None,
        "lr": lr,
        "seconds": round(seconds, 1),
    }


def train(
    drafter: D3DDrafter,
    records: Sequence[dict],
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    val_records: Sequence[dict] = (),
    resume: bool = True,
    progress: bool = True,
    on_val: Callable[[int, dict], None] | None = None,
) -> TrainResult:
    """Train ``drafter`` in place on records with ``prompt_ids`` / ``response_ids``.

    With ``out_dir``: checkpoints to ``out_dir/last`` every ``save_every`` steps, resumes from
    it when present (and ``resume``), logs to ``out_dir/log.jsonl``, and saves ``out_dir/final``.
    """
    if not records:
        raise ValueError("no training records")
    out = Path(out_dir) if out_dir is not None else None
    params = trainable(drafter)
    for p in params:
        p.requires_grad_(True)
        if drafter.device.type == "cuda":
            p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    start = 0
    if out is not None and resume and (out / "last" / TRAINER_FILE).is_file():
        state = torch.load(out / "last" / TRAINER_FILE, map_location=drafter.device)
        weights = load_file(str(out / "last" / WEIGHTS_FILE), device=str(drafter.device))
        _, unexpected = drafter.load_state_dict(weights, strict=False)
        if unexpected:
            raise ValueError(f"{out / 'last'} does not fit this drafter: {unexpected[:3]}")
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = int(state["step"])
        log.info("resuming from step %d", start)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    logf = (out / "log.jsonl").open("a") if out is not None else None

    result = TrainResult(steps=start, loss=math.nan)
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=start, desc="train", disable=not progress)
    try:
        for step in range(start, cfg.steps):
            drafter.train()
            opt.zero_grad(set_to_none=True)
            parts = _accumulate(drafter, records, cfg, step)
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            result.steps = step + 1
            if parts:
                row = _log_row(step + 1, parts, sched.get_last_lr()[0], time.perf_counter() - t0)
                result.loss = row["loss"]
                bar.set_postfix(loss=f"{row['loss']:.3f}", block=f"{row['block']:.3f}")
                if logf:
                    logf.write(json.dumps(row) + "\n")
                    logf.flush()
            bar.update(1)
            last = step + 1 == cfg.steps
            if out is not None and ((step + 1) % cfg.save_every == 0 or last):
                save_state(drafter, opt, sched, step + 1, out / "last")
            if val_records and ((step + 1) % cfg.val_every == 0 or last):
                drafter.eval()
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
    for p in params:
        p.requires_grad_(False)
    if out is not None:
        drafter.save(out / "final")
        plot_log(out / "log.jsonl", out / "curve.png")
    result.seconds = time.perf_counter() - t0
    return result


def read_log(path: str | Path) -> tuple[dict[int, dict], dict[int, float]]:
    """Training rows and validation acceptance by step from ``log.jsonl``; when a resumed run
    repeats steps, the last line for a step wins."""
    rows: dict[int, dict] = {}
    val: dict[int, float] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "val_acceptance_length" in row:
            val[int(row["step"])] = float(row["val_acceptance_length"])
        elif "loss" in row:
            rows[int(row["step"])] = row
    return dict(sorted(rows.items())), dict(sorted(val.items()))


def plot_log(log_path: str | Path, png: str | Path, window: int = 50) -> Path | None:
    """Loss (raw and a ``window``-step moving average) and validation acceptance vs step."""
    rows, val = read_log(log_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(rows)
    loss = [rows[s]["loss"] for s in steps]
    avg = [sum(loss[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1)
           for i in range(len(loss))]  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.6, label="training loss")
    ax.plot(steps, avg, color="tab:blue", lw=1.4, label=f"loss, {window}-step mean")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if val:
        ax2 = ax.twinx()
        ax2.plot(list(val), list(val.values()), "o-", color="tab:red", label="val acceptance")
        ax2.set_ylabel("validation acceptance length")
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88), fontsize=8)
    ax.set_title("Drafter training")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)
