"""Progressive layer pruning of a trained drafter (DESIGN.md §2).

Design: a stage removes one layer. For each remaining layer, the validation acceptance length
(offline, :mod:`.accept`) is measured with that layer removed; the layer whose removal costs
least goes, the smaller drafter is recovery-trained for a few steps (:mod:`.train`), and its
acceptance length and block forward time are measured again. The figure of merit is the
estimated synchronous speed-up over the target alone,

    speedup = AL * t_step / (t_block + t_verify),

i.e. acceptance length x drafter speed: tokens per round over the round's cost, in units of
target decode steps. Pruning stops when the score has not improved for ``patience`` stages, at
``min_layers``, or after ``max_stages``; the chosen stage is the one with the best score. Each
stage's drafter is saved under ``OUT/stage_<k>/final`` and the table is rewritten after every
stage (``stages.json``, ``stages.md``, ``pruning.png``), so a rerun resumes after the last
finished stage.
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from d3d.backends.hf import trim_cache, with_cache
from d3d.model.drafter import D3DDrafter, DrafterMeta
from d3d.model.skeleton import finish, meta_lm
from d3d.training.accept import offline_acceptance
from d3d.training.train import TrainConfig, train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PruneConfig:
    """When to stop, how to recover, and how to time the drafter against the target."""

    min_layers: int = 2
    max_stages: int = 4
    patience: int = 1
    recovery: TrainConfig = field(default_factory=lambda: TrainConfig(steps=30, warmup=3))
    val_stride: int = 8
    timing_context: int = 400
    timing_repeats: int = 15

    def __post_init__(self) -> None:
        if self.min_layers < 1 or self.max_stages < 1 or self.patience < 1:
            raise ValueError("min_layers, max_stages and patience must be >= 1")


@dataclass
class Stage:
    """One row of the pruning table."""

    stage: int
    layers_kept: int
    layers: list[int]
    removed: int | None
    acceptance_length: float
    acceptance_before_recovery: float | None
    drafter_block_ms: float
    target_verify_ms: float
    target_step_ms: float
    estimated_speedup: float
    candidates: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def drop_layers(drafter: D3DDrafter, keep: Sequence[int]) -> D3DDrafter:
    """A copy of ``drafter`` with only the layers at positions ``keep`` (embeddings and LM head
    shared with it, whether they are the target's or the drafter's own; the kept layers copied;
    nothing vocabulary-sized built). ``meta.layers`` keeps naming the layers of the model they
    came from (the target's, or the ``--init`` model's)."""
    keep = list(keep)
    src = drafter.lm.model.layers
    if not keep or any(i < 0 or i >= len(src) for i in keep):
        raise ValueError(f"keep must be positions in [0, {len(src)}), got {keep}")
    cfg = copy.deepcopy(drafter.lm.config)
    cfg.num_hidden_layers = len(keep)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in keep]
    emb = drafter.lm.get_input_embeddings().weight
    lm = meta_lm(cfg, emb.dtype, cfg._attn_implementation)

    def copied(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    for j, i in enumerate(keep):
        lm.model.layers[j].load_state_dict(copied(src[i]), assign=True)
    lm.model.norm.load_state_dict(copied(drafter.lm.model.norm), assign=True)
    lm.set_input_embeddings(drafter.lm.get_input_embeddings())
    lm.set_output_embeddings(drafter.lm.get_output_embeddings())
    finish(lm, emb.device, rotary=drafter.lm.model.rotary_emb)
    meta_d = asdict(drafter.meta)
    meta_d["layers"] = tuple(drafter.meta.layers[i] for i in keep)
    out = D3DDrafter(lm, DrafterMeta(**meta_d), drafter.mask_embedding.detach().clone())
    if drafter.draft_ids is not None:
        out.set_draft_vocab(drafter.draft_ids)
    out.to(drafter.device)
    out.eval()
    return out


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


@torch.inference_mode()
def time_drafter_block(drafter: D3DDrafter, context: int, repeats: int) -> float:
    """Median ms of one block forward after a cached prefix of ``context`` tokens."""
    cache = DynamicCache()
    g = torch.Generator().manual_seed(0)
    vocab = drafter.lm.get_input_embeddings().num_embeddings
    drafter.encode(torch.randint(0, vocab, (context,), generator=g).tolist(), cache)
    return _median_ms(lambda: drafter.block_scores(5, cache), repeats)


@torch.inference_mode()
def time_target(
    model: PreTrainedModel, context: int, repeats: int, block: int
) -> tuple[float, float]:
    """Median ms of the target's ``block``-token verify forward and of a 1-token step."""
    dev = next(model.parameters()).device
    cache = DynamicCache()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (1, context), generator=g)
    ids = ids.to(dev)
    model(input_ids=ids, **with_cache(model, cache))

    def forward(n: int):
        x = torch.full((1, n), 7, device=dev)
        pos = torch.arange(context, context + n, device=dev).unsqueeze(0)
        model(input_ids=x, position_ids=pos, **with_cache(model, cache))
        trim_cache(cache, n)

    return _median_ms(lambda: forward(block), repeats), _median_ms(lambda: forward(1), repeats)


def speedup(al: float, block_ms: float, verify_ms: float, step_ms: float) -> float:
    """Estimated synchronous speed-up over the target alone (see the module docstring)."""
    return al * step_ms / (block_ms + verify_ms)


def _write_report(stages: list[Stage], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    best = max(stages, key=lambda s: s.estimated_speedup)
    doc = {"chosen_stage": best.stage, "stages": [asdict(s) for s in stages]}
    (out / "stages.json").write_text(json.dumps(doc, indent=2))
    (out / "stages.md").write_text(markdown_table(stages, best.stage))
    plot(stages, out / "pruning.png", best.stage)


def markdown_table(stages: Sequence[Stage], chosen: int | None = None) -> str:
    rows = [
        "| stage | layers kept | removed | AL before recovery | AL | drafter block ms "
        "| block / verify | est. speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in stages:
        before = (
            "" if s.acceptance_before_recovery is None else f"{s.acceptance_before_recovery:.3f}"
        )
        mark = " **(chosen)**" if s.stage == chosen else ""
        rows.append(
            f"| {s.stage}{mark} | {s.layers_kept} | {'' if s.removed is None else s.removed} "
            f"| {before} | {s.acceptance_length:.3f} | {s.drafter_block_ms:.1f} "
            f"| {s.drafter_block_ms / s.target_verify_ms:.2f} | {s.estimated_speedup:.2f}x |"
        )
    return "\n".join(rows) + "\n"


def plot(stages: Sequence[Stage], path: Path, chosen: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.layers_kept for s in stages]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [s.acceptance_length for s in stages], "o-", label="acceptance length (val)")
    ax.set_xlabel("drafter layers kept")
    ax.set_xticks(x)
    ax.set_ylabel("acceptance length")
    ax.invert_xaxis()
    ax2 = ax.twinx()
    ax2.plot(
        x, [s.estimated_speedup for s in stages], "s--", color="tab:red", label="est. speed-up"
    )
    ax2.set_ylabel("estimated sync speed-up (x)")
    if chosen is not None:
        ax.axvline(stages[chosen].layers_kept, color="grey", lw=0.8, ls=":")
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88), fontsize=8)
    ax.set_title("Progressive layer pruning")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure(drafter: D3DDrafter, target: PreTrainedModel, val: Sequence[dict], cfg: PruneConfig):
    al = offline_acceptance(drafter, val, mode="stride", stride=cfg.val_stride).acceptance_length
    block = time_drafter_block(drafter, cfg.timing_context, cfg.timing_repeats)
    verify, step = time_target(target, cfg.timing_context, cfg.timing_repeats, drafter.block_size)
    return al, block, verify, step


def prune(
    drafter: D3DDrafter,
    target: PreTrainedModel,
    train_records: Sequence[dict],
    val_records: Sequence[dict],
    cfg: PruneConfig,
    out_dir: str | Path,
    progress: bool = True,
) -> tuple[list[Stage], D3DDrafter]:
    """Run pruning stages (see the module docstring); returns the table and the chosen drafter."""
    if drafter.adapters is not None:
        raise ValueError(
            "an adapter drafter's layers are the target's own, frozen: choose its depth with the "
            "depth sweep (python -m d3d.training.sweep) instead of pruning"
        )
    out = Path(out_dir)
    stages: list[Stage] = []
    if (out / "stages.json").is_file():
        stages = [Stage(**s) for s in json.loads((out / "stages.json").read_text())["stages"]]
        drafter = D3DDrafter.load(out / f"stage_{stages[-1].stage}", target, device=drafter.device)
        log.info("resuming after stage %d", stages[-1].stage)
    else:
        t0 = time.perf_counter()
        al, block, verify, step = measure(drafter, target, val_records, cfg)
        n = len(drafter.meta.layers)
        stages.append(
            Stage(0, n, list(drafter.meta.layers), None, al, None, block, verify, step,
                  speedup(al, block, verify, step), seconds=time.perf_counter() - t0)
        )  # fmt: skip
        drafter.save(out / "stage_0")
        _write_report(stages, out)
    # Stages since the best score so far (a resumed run keeps its stopping state).
    best_at = max(range(len(stages)), key=lambda i: stages[i].estimated_speedup)
    best, stale = stages[best_at].estimated_speedup, len(stages) - 1 - best_at
    while (
        len(stages) <= cfg.max_stages
        and stages[-1].layers_kept > cfg.min_layers
        and stale < cfg.patience
    ):
        t0 = time.perf_counter()
        k = stages[-1].stage + 1
        n = len(drafter.meta.layers)
        cands = {}
        for i in range(n):
            cand = drop_layers(drafter, [j for j in range(n) if j != i])
            cands[i] = offline_acceptance(
                cand, val_records, mode="stride", stride=cfg.val_stride
            ).acceptance_length
            log.info("stage %d: without layer %d -> AL %.3f", k, drafter.meta.layers[i], cands[i])
        worst = max(cands, key=cands.get)
        names = list(drafter.meta.layers)
        removed = names[worst]
        drafter = drop_layers(drafter, [j for j in range(n) if j != worst])
        train(drafter, train_records, cfg.recovery, out / f"stage_{k}_train", progress=progress)
        al, block, verify, step = measure(drafter, target, val_records, cfg)
        stages.append(
            Stage(k, n - 1, list(drafter.meta.layers), removed, al, cands[worst], block, verify,
                  step, speedup(al, block, verify, step),
                  {str(names[i]): round(v, 4) for i, v in cands.items()},
                  time.perf_counter() - t0)
        )  # fmt: skip
        drafter.save(out / f"stage_{k}")
        _write_report(stages, out)
        if stages[-1].estimated_speedup > best:
            best, stale = stages[-1].estimated_speedup, 0
        else:
            stale += 1
    chosen = max(stages, key=lambda s: s.estimated_speedup)
    return stages, D3DDrafter.load(out / f"stage_{chosen.stage}", target, device=drafter.device)
