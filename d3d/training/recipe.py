"""The drafter recipe for a Qwen3 target: one command per stage, and the compute each needs.

Design:

- A :class:`Recipe` holds every choice (target, the model the drafter starts from, how many
  prompts, answer lengths, epochs, batch, pruning and evaluation budgets, GPUs).
  :func:`stage_commands` turns it into the ``d3d`` command lines of the four stages — data,
  train, prune, evaluate — and :func:`compute` into tokens, FLOPs and GPU-hours per stage. The
  documented recipe and the end-to-end test on tiny models run the *same* function, so the
  printed commands are known to parse and run.
- FLOPs: a forward costs 2 N per token (N = parameters that multiply: the layers and the LM
  head, not the embedding lookup) plus attention, 4 x layers x heads x head_dim x context;
  training costs 3x a forward for what trains and 2x for a frozen LM head (gradients flow
  through it, none are kept for it), 4x with gradient checkpointing (one more forward).
  GPU-hours = FLOPs / (peak x utilisation); the stated utilisation (40% of the bf16 dense
  peak) is a planning figure, not a measurement.
- Generating the data is a decode: each step reads the target's weights once for the whole
  batch, so it is bound by memory bandwidth unless the batch is large. Its time is the larger
  of the FLOP figure and weights-plus-KV bytes per step x steps / (bandwidth x efficiency).
- ``python -m d3d.training.recipe qwen3-8b`` prints both (Markdown) and ``--json FILE`` writes
  them.

Letters: N parameters, L layers, H hidden, V vocabulary, B block size.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

BLOCK = 16


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's size (Qwen3 layout: GQA, SwiGLU, q/k norms)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 151_936
    tied: bool = False

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim
        return attn + 3 * h * self.intermediate + 2 * h

    @property
    def body(self) -> int:
        """Parameters of the layers and the final norm."""
        return self.layers * self.layer_params + self.hidden

    @property
    def params(self) -> int:
        return self.body + self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def head(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes(self, dtype_bytes: int = 2) -> int:
        """KV bytes per token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def attention(self, context: float) -> float:
        """Attention FLOPs of one token's forward at ``context``."""
        return 4 * self.layers * self.heads * self.head_dim * context


# Published Qwen3 shapes (config.json of each model).
SHAPES = {
    "Qwen/Qwen3-0.6B": Shape(28, 1024, 3072, 16, 8, tied=True),
    "Qwen/Qwen3-1.7B": Shape(28, 2048, 6144, 16, 8, tied=True),
    "Qwen/Qwen3-4B": Shape(36, 2560, 9728, 32, 8, tied=True),
    "Qwen/Qwen3-8B": Shape(36, 4096, 12288, 32, 8),
    "Qwen/Qwen3-32B": Shape(64, 5120, 25600, 64, 8),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    bandwidth: float  # HBM bytes/s
    memory: float  # bytes


GPUS = {
    "h100": Gpu("H100 SXM", 989e12, 3.35e12, 80e9),
    "h200": Gpu("H200", 989e12, 4.8e12, 141e9),
}


@dataclass(frozen=True)
class Recipe:
    """Every choice of a drafter run (defaults: the Qwen3-8B recipe on eight GPUs)."""

    name: str = "qwen3-8b"
    target: str = "Qwen/Qwen3-8B"
    init: str = "Qwen/Qwen3-1.7B"
    root: str = "runs/qwen3-8b"
    prompts_file: str = "prompts/mix.jsonl"  # jsonl: prompt or messages, see d3d.training.sources
    device: str = "cuda"
    dtype: str = "bfloat16"
    gpus: int = 8
    gpu: str = "h100"  # what the compute table assumes (GPUS)
    drafter_device: str | None = None  # prune / evaluate: the drafter on its own GPU
    threads: int | None = None  # torch CPU threads (CPU runs)
    # data
    prompts: int = 200_000
    mean_prompt: int = 150  # tokens, chat template included (an estimate of the mix)
    mean_response: int = 600  # tokens of a non-thinking answer (an estimate; measure it)
    max_new_tokens: int = 2048
    max_prompt_tokens: int = 2048
    data_batch: int = 128  # requests decoding at once, per GPU
    data_engine: str = "vllm"  # what decodes the data on GPUs (on a CPU: the own engine)
    heldout_fraction: float = 0.01
    # train
    epochs: float = 3.0
    global_batch: int = 64  # sequences per optimizer step, over all GPUs
    max_len: int = 3072
    anchors: int = 64
    lr: float = 3e-4
    warmup: int = 200
    gamma: float = 7.0
    ntp_weight: float = 0.5
    parallel: str = "ddp"
    grad_checkpointing: bool = True
    val_seqs: int = 64
    val_every: int = 500
    save_every: int = 250
    # prune
    min_layers: int = 20
    max_stages: int = 8
    patience: int = 2
    recovery_steps: int = 200
    recovery_batch: int = 16
    val_stride: int = 16
    # evaluate
    eval_prompts: int = 200
    eval_tokens: int = 1024
    expected_acceptance: float = 5.0  # rounds of sync decoding = eval_tokens / this

    @property
    def train_steps(self) -> int:
        train = self.prompts * (1 - self.heldout_fraction) - self.val_seqs
        return max(1, math.ceil(self.epochs * train / self.global_batch))

    @property
    def data_path(self) -> str:
        return f"{self.root}/data.jsonl"  # with its shards: d3d.training.data.data_files


QWEN3_8B = Recipe()
QWEN3_32B = Recipe(
    name="qwen3-32b",
    target="Qwen/Qwen3-32B",
    init="Qwen/Qwen3-4B",
    root="runs/qwen3-32b",
    gpu="h200",  # the 32B target's weights and a batch's KV need more than 80 GB
    drafter_device="cuda:1",  # prune: 65 GB of target beside 58 GB of training state
    data_batch=64,
    parallel="fsdp",
    min_layers=26,
    max_stages=10,
)
RECIPES = {r.name: r for r in (QWEN3_8B, QWEN3_32B)}


def _model_flags(r: Recipe) -> list[str]:
    return ["--target", r.target, "--device", r.device, "--dtype", r.dtype]


def stage_commands(r: Recipe) -> dict[str, list[str]]:
    """``d3d`` arguments of each stage (data and train run under :func:`launcher`)."""
    one = f"{r.device}:0" if r.device.startswith("cuda") else r.device
    apart = ["--drafter-device", r.drafter_device] if r.drafter_device else []
    train_flags = ["--max-len", r.max_len, "--anchors", r.anchors, "--gamma", r.gamma,
                   "--ntp-weight", r.ntp_weight, "--val-seqs", r.val_seqs,
                   "--val-stride", r.val_stride]  # fmt: skip
    data = ["data", *_model_flags(r), "--prompts", r.prompts_file, "--out", r.data_path,
            "--max-new-tokens", r.max_new_tokens, "--max-prompt-tokens", r.max_prompt_tokens,
            "--batch-size", r.data_batch, "--heldout-fraction", r.heldout_fraction,
            "--quiet"]  # fmt: skip
    if _vllm_data(r):  # vLLM's batching on every GPU: a process per GPU, not torchrun
        data += ["--engine", "vllm", "--gpus", r.gpus]
    train = ["train", *_model_flags(r), "--init", r.init, "--data", r.data_path,
             "--out", f"{r.root}/train", "--steps", r.train_steps, "--grad-accum",
             r.global_batch, "--lr", r.lr, "--warmup", r.warmup, *train_flags,
             "--val-every", r.val_every, "--save-every", r.save_every, "--keep-every",
             r.val_every * 4, "--parallel", r.parallel, "--quiet"]  # fmt: skip
    if r.grad_checkpointing:
        train.append("--grad-checkpointing")
    prune = ["prune", "--target", r.target, "--device", one, *apart, "--dtype", r.dtype, "--drafter",
             f"{r.root}/train/final", "--data", r.data_path, "--out", f"{r.root}/prune",
             "--min-layers", r.min_layers, "--max-stages", r.max_stages, "--patience",
             r.patience, "--recovery-steps", r.recovery_steps, "--grad-accum",
             r.recovery_batch, "--lr", r.lr / 6, "--warmup", max(1, r.recovery_steps // 20),
             *train_flags]  # fmt: skip
    evaluate = ["drafter-eval", "--target", r.target, "--device", one, *apart, "--dtype", r.dtype,
                "--drafter", f"{r.root}/prune/chosen", "--prompts", r.data_path, "--limit",
                r.eval_prompts, "--max-new-tokens", r.eval_tokens, "--json"]  # fmt: skip
    stages = {"data": data, "train": train, "prune": prune, "evaluate": evaluate}
    threads = ["--threads", r.threads] if r.threads else []
    return {k: [_arg(a) for a in [*v, *threads]] for k, v in stages.items()}


def _arg(a: object) -> str:
    return f"{a:g}" if isinstance(a, float) else str(a)


def _vllm_data(r: Recipe) -> bool:
    return r.data_engine == "vllm" and r.device.startswith("cuda")


def launcher(r: Recipe, stage: str) -> list[str]:
    """How a stage starts: torchrun over the GPUs (train: DDP/FSDP; data on the own engine: a
    shard each; ``d3d data --engine vllm --gpus N`` starts its own process per GPU)."""
    if stage == "data" and _vllm_data(r):
        return ["d3d"]
    if r.gpus > 1 and stage in ("data", "train"):
        return ["torchrun", "--nproc_per_node", str(r.gpus), "-m", "d3d"]
    return ["d3d"]


@dataclass(frozen=True)
class StageCompute:
    stage: str
    tokens: float  # tokens through the model that dominates the stage
    flops: float
    gpu_hours: float
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


def compute(r: Recipe, gpu: Gpu = GPUS["h100"], mfu: float = 0.4, bw_eff: float = 0.6):
    """Tokens, FLOPs and GPU-hours of each stage (see the module docstring)."""
    t, d = SHAPES[r.target], SHAPES[r.init]
    rate = gpu.bf16_flops * mfu
    seq = min(r.mean_prompt + r.mean_response, r.max_len)
    out = []

    # data: prefill the prompts, decode the answers (the target)
    resp, prm = r.prompts * r.mean_response, r.prompts * r.mean_prompt
    ctx = r.mean_prompt + r.mean_response / 2
    flops = 2 * (t.body + t.head) * (resp + prm) + t.attention(ctx) * (resp + prm)
    steps = resp / r.data_batch
    step_bytes = 2 * t.params + r.data_batch * ctx * t.kv_bytes()
    bw_s = steps * step_bytes / (gpu.bandwidth * bw_eff)
    hours = max(flops / rate, bw_s) / 3600
    why = "bandwidth" if bw_s > flops / rate else "FLOPs"
    kv_max = r.data_batch * (r.mean_prompt + r.max_new_tokens) * t.kv_bytes()
    mem = (2 * t.params + kv_max) / 1e9
    fits = "" if mem * 1e9 < 0.9 * gpu.memory else f" (more than a {gpu.name} holds)"
    out.append(StageCompute("data", resp, flops, hours,
                            f"{r.prompts:,} prompts x {r.mean_response} answer tokens, batch "
                            f"{r.data_batch}/GPU, bound by {why}; {mem:.0f} GB of weights and "
                            f"KV at the longest answers per GPU{fits}"))  # fmt: skip

    # train: every sequence's clean tokens and its blocks, one packed forward
    rows = seq + r.anchors * BLOCK
    labelled = r.anchors * (BLOCK - 1) + (r.mean_response if r.ntp_weight else 0)
    fwd = 2 * d.body * rows + d.attention(seq / 2) * rows
    per_seq = (4 if r.grad_checkpointing else 3) * fwd + 2 * 2 * d.head * labelled
    seqs = r.train_steps * r.global_batch
    flops = seqs * per_seq
    # fp32 weights, gradients and AdamW's two moments of what trains; the frozen embeddings
    # (and the target's, for its vocabulary) in bf16; FSDP shards the layers' part.
    state = 16 * d.body / (r.gpus if r.parallel == "fsdp" else 1)
    state += 2 * (d.params - d.body) + 2 * 2 * t.head
    out.append(StageCompute("train", seqs * rows, flops, flops / rate / 3600,
                            f"{r.train_steps:,} steps x {r.global_batch} sequences ({r.epochs:g} "
                            f"epochs), {rows} rows each ({r.anchors} blocks of {BLOCK}); "
                            f"{r.parallel}: {state / 1e9:.0f} GB of weights and optimizer "
                            f"state per GPU before activations"))  # fmt: skip

    # prune: each stage scores every remaining layer's removal, then recovers
    val_rows = r.val_seqs * seq
    flops = tokens = 0.0
    for k in range(r.max_stages):
        n = d.layers - k
        if n <= r.min_layers:
            break
        per_layer = d.body / d.layers
        score = n * val_rows * (2 * (n - 1) * per_layer + 2 * d.head / r.val_stride)
        recover = r.recovery_steps * r.recovery_batch * per_seq * (n - 1) / d.layers
        flops += score + recover
        tokens += n * val_rows + r.recovery_steps * r.recovery_batch * rows
    where = f"target on one GPU, drafter on {r.drafter_device}" if r.drafter_device else "one GPU"
    out.append(StageCompute("prune", tokens, flops, flops / rate / 3600,
                            f"up to {r.max_stages} stages from {d.layers} layers, "
                            f"{r.recovery_steps} recovery steps each; {where}"))  # fmt: skip

    # evaluate: each prompt decoded by the target alone, then with the drafter
    toks = r.eval_prompts * r.eval_tokens
    rounds = toks / r.expected_acceptance
    flops = 2 * (t.body + t.head) * toks + rounds * BLOCK * 2 * (t.body + t.head + d.body + d.head)
    ar_s = toks * 2 * t.params / (gpu.bandwidth * bw_eff)  # batch 1: bandwidth-bound
    sync_s = rounds * 2 * (t.params + d.params) / (gpu.bandwidth * bw_eff)
    out.append(StageCompute("evaluate", toks, flops, (ar_s + sync_s) / 3600,
                            f"{r.eval_prompts} held-out prompts x {r.eval_tokens} tokens, ar then "
                            f"sync at batch 1 (bandwidth-bound)"))  # fmt: skip
    return out


def shell(args: list[str], width: int = 96) -> str:
    """One command as a shell line, wrapped with backslashes between flags (a flag stays with
    its values)."""
    units: list[str] = []
    for a in args:
        if units and not a.startswith("-") and units[-1].startswith("-"):
            units[-1] += f" {a}"
        else:
            units.append(a)
    lines, cur = [], ""
    for u in units:
        if cur and len(cur) + 1 + len(u) > width:
            lines.append(cur + " \\")
            cur = "  " + u
        else:
            cur = f"{cur} {u}" if cur else u
    return "\n".join([*lines, cur])


def markdown(r: Recipe, gpu: Gpu, mfu: float) -> str:
    rows = compute(r, gpu, mfu)
    t, d = SHAPES[r.target], SHAPES[r.init]
    head = (
        f"**{r.name}**: target {r.target} ({t.params / 1e9:.2f}B), drafter from {r.init} "
        f"({d.params / 1e9:.2f}B, {d.layers} layers, hidden {d.hidden}); {gpu.name}, "
        f"{mfu:.0%} of the bf16 dense peak ({gpu.bf16_flops / 1e12:.0f} TFLOP/s)\n\n"
        "| stage | tokens | FLOPs | GPU-hours | on "
        f"{r.gpus} GPUs | what |\n|---|---:|---:|---:|---:|---|\n"
    )
    body = "".join(
        f"| {s.stage} | {s.tokens:.3g} | {s.flops:.2e} | {s.gpu_hours:.1f} | "
        f"{s.gpu_hours / (r.gpus if s.stage in ('data', 'train') else 1):.1f} h | {s.note} |\n"
        for s in rows
    )
    total = sum(s.gpu_hours for s in rows)
    return head + body + f"| total | | | {total:.1f} | | |\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m d3d.training.recipe", description=__doc__)
    p.add_argument("recipe", choices=sorted(RECIPES))
    p.add_argument("--gpu", default=None, choices=sorted(GPUS), help="default: the recipe's")
    p.add_argument("--mfu", type=float, default=0.4, help="share of the bf16 dense peak")
    p.add_argument("--json", default=None, help="also write commands and compute here")
    args = p.parse_args(argv)
    r = RECIPES[args.recipe]
    gpu = GPUS[args.gpu or r.gpu]
    print(markdown(r, gpu, args.mfu))
    cmds = stage_commands(r)
    print("```bash")
    for stage, argv_ in cmds.items():
        print(f"# {stage}\n{shell(launcher(r, stage) + argv_)}")
    print("```")
    if args.json:
        doc = {"recipe": asdict(r), "gpu": asdict(gpu), "mfu": args.mfu,
               "commands": {k: launcher(r, k) + v for k, v in cmds.items()},
               "compute": [s.to_dict() for s in compute(r, gpu, args.mfu)]}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
