"""``d3d plan``: the memory a target and drafter will take, per device, from their configs alone.

Models are built on the meta device from a config (a ``config.json`` file, a folder holding
one, or ``qwen3-8b`` / ``qwen3-32b``: the published shapes shipped in ``d3d/configs/``) — shapes
without storage, no weights, no download — and counted in the chosen dtype
(:mod:`d3d.model.memory` has the arithmetic):

- **Weights**: every parameter once (a tied head once). A ``self:`` drafter on the target's
  device runs on the target's own tensors (the engine shares them) and adds its mask embedding
  (and the head rows of a draft vocabulary); elsewhere (``cuda:1``, or its own process:
  ``cpu:N``) it holds its layers, final norm, embeddings and LM head. A drafter given as a config
  is a model of its own.
- **KV cache**: bytes per token = 2 x layers x KV heads x head dim x element size; at
  ``--max-kv-tokens`` per sequence, for ``--batch`` sequences. The drafter keeps its own, for
  its layers.
- **Workspace** (one forward's working set; layers run one after another): the target's larger
  of a prefill (``--prefill-chunk`` rows, logits for the last row only) and a verify forward
  (batch x B rows, logits over all of them in dtype plus float32 probabilities); the drafter's
  larger of reading a prompt (the same rows) and its branch forward: ``--rows`` requests x
  ``--branches`` blocks of B rows plus a chain of up to B, their activations and 4D mask, and
  logits over the K = B-1 slots of each block, V_d wide (``--draft-vocab``; 0: all of V).
  Attention scores are taken as never materialised (flash / memory-efficient kernels).
- **Peak per device**: weights + KV + workspaces of everything on it (drafting runs while the
  target verifies, so both workspaces count; a ``/qa`` document read by the drafter, about 1.5
  rows a token with the question scorer's copies, runs beside drafting and counts too).
- **Processes** (``--engine``): the own engine is one process (the drafter a thread of it on a
  GPU, a process of its own on CPU cores); beside vLLM there are three: the API process (the
  tokenizer, no weights), vLLM's engine core (the target; its KV pool is ``--max-kv-tokens``
  worth when the service is given that, else 90% of the device) and the drafter worker (the
  drafter, which never shares the target's tensors there, and the ``/qa`` reading). On a GPU the
  drafter's KV is the packed drafter's slot pool, allocated at its start
  (:data:`d3d.backends.cuda.drafter.KV_TOKENS` positions).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from d3d.backends.cuda.drafter import KV_TOKENS as DRAFTER_KV_TOKENS
from d3d.backends.sizes import dtype_bytes, kv_bytes_per_token
from d3d.model import shapes
from d3d.model.load import resolve_dtype
from d3d.model.memory import activation_bytes_per_row, param_bytes
from d3d.model.skeleton import meta_lm
from d3d.model.specs import self_layers

GIB = 2**30
QUESTION_ROWS = 1.5  # rows the question scorer runs per document token (its question copies)
ENGINES = ("own", "vllm")


class PlanError(ValueError):
    """A plan's inputs cannot be read; the message says why in one line."""


def load_config(spec: str) -> tuple[str, PretrainedConfig]:
    """A model config from a shipped name, a ``config.json`` file or a model folder
    (:func:`d3d.model.shapes.load_config`)."""
    try:
        return shapes.load_config(spec)
    except shapes.ShapeError as exc:
        raise PlanError(str(exc)) from None


@dataclass(frozen=True)
class PlanSettings:
    target: str
    drafter: str = "self:4"
    dtype: str = "bfloat16"
    batch: int = 1
    max_kv_tokens: int = 4096
    prefill_chunk: int = 0  # rows of a prefill forward (0: a whole --max-kv-tokens prompt)
    branches: int = 8
    block_size: int = 16
    rows: int = 1  # requests whose branches share one drafter forward
    draft_vocab: int = 0
    device: str = "cuda:0"
    drafter_device: str | None = None
    engine: str = "own"  # own: one process; vllm: vLLM's engine core and a drafter worker
    document_tokens: int = 0  # a /qa document the drafter reads (0: --max-kv-tokens)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise PlanError(f"engine: one of {', '.join(ENGINES)}, got {self.engine!r}")
        for name in ("batch", "max_kv_tokens", "rows"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_chunk", "branches", "draft_vocab", "document_tokens"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.block_size < 2:
            raise PlanError(f"block_size: must be >= 2, got {self.block_size}")

    @property
    def where_drafter(self) -> str:
        return self.drafter_device or self.device


@dataclass(frozen=True)
class Part:
    """One model's bytes on its device; ``notes`` says how each figure was counted."""

    name: str
    device: str
    dtype: str
    layers: int
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_at_max: int  # one sequence of --max-kv-tokens
    kv_bytes: int  # x batch
    workspace_bytes: int
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    settings: PlanSettings
    target: Part
    drafter: Part

    def devices(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for part in (self.target, self.drafter):
            d = out.setdefault(part.device, dict.fromkeys(("weights", "kv", "workspace"), 0))
            d["weights"] += part.weight_bytes
            d["kv"] += part.kv_bytes
            d["workspace"] += part.workspace_bytes
        for d in out.values():
            d["peak"] = d["weights"] + d["kv"] + d["workspace"]
        return out

    def processes(self) -> list[dict]:
        """Every process the service runs, what it holds and on which device (bytes: weights,
        KV and workspace there; the API process beside vLLM holds no model)."""
        t, d, s = self.target, self.drafter, self.settings

        def total(p: Part) -> int:
            return p.weight_bytes + p.kv_bytes + p.workspace_bytes

        if s.engine == "vllm":
            return [
                {"process": "d3d serve (API)", "device": "cpu", "holds": "tokenizer, no weights",
                 "bytes": 0},
                {"process": "vLLM engine core", "device": t.device,
                 "holds": "target: weights, KV pool, workspace", "bytes": total(t)},
                {"process": "drafter worker", "device": d.device,
                 "holds": "drafter: weights, slot KV, branches + /qa reading", "bytes": total(d)},
            ]  # fmt: skip
        own = {"process": "d3d serve (API + engine)", "device": t.device,
               "holds": "target: weights, KV, workspace", "bytes": total(t)}  # fmt: skip
        where = "drafter worker" if d.device.startswith("cpu") else "d3d serve (API + engine)"
        what = "drafter (layers shared)" if d.device == t.device else "drafter"
        drafter = {"process": where, "device": d.device,
                   "holds": f"{what}: weights, KV, branches + /qa reading", "bytes": total(d)}  # fmt: skip
        return [own, drafter]

    def to_dict(self) -> dict:
        return {
            "settings": asdict(self.settings),
            "target": asdict(self.target),
            "drafter": asdict(self.drafter),
            "devices": {
                dev: {f"{k}_bytes": v for k, v in d.items()} for dev, d in self.devices().items()
            },
            "processes": self.processes(),
        }

    def table(self) -> str:
        s, t, d = self.settings, self.target, self.drafter
        lines = [
            f"target {t.name}: {t.layers} layers, {t.parameters / 1e9:.2f} B parameters, {t.dtype}"
            f" on {t.device}; drafter {d.name}: {d.layers} layers, {d.dtype} on {d.device}",
            f"batch {s.batch}, {s.max_kv_tokens:,} KV tokens a sequence, {s.branches} branches x "
            f"block {s.block_size}, {s.rows} request(s) per branch forward",
            "",
            "| what | device | bytes | GiB | how |",
            "|---|---|---:|---:|---|",
        ]
        for part in (t, d):
            who = "target" if part is t else "drafter"
            for key, label in (("weight_bytes", "weights"), ("kv_bytes", "KV cache"),
                               ("workspace_bytes", "workspace")):  # fmt: skip
                n = getattr(part, key)
                lines.append(
                    f"| {who} {label} | {part.device} | {n:,} | {n / GIB:.2f} | {part.notes[key]} |"
                )
        for dev, v in self.devices().items():
            lines.append(f"| **peak** | {dev} | {v['peak']:,} | **{v['peak'] / GIB:.2f}** | |")
        lines += ["", "| process | device | holds | GiB |", "|---|---|---|---:|"]
        for p in self.processes():
            lines.append(
                f"| {p['process']} | {p['device']} | {p['holds']} | {p['bytes'] / GIB:.2f} |"
            )
        if s.engine == "vllm":
            lines.append(
                "\nvLLM sizes its KV pool to --max-kv-tokens when the service is given one "
                "(kv_cache_memory_bytes); otherwise it takes 90% of the target's device "
                "(gpu_memory_utilization) and the KV line above is the least it needs."
            )
        lines.append(
            f"\nKV bytes a token: target {t.kv_bytes_per_token:,}, drafter {d.kv_bytes_per_token:,}"
            f"; at {s.max_kv_tokens:,} tokens: {t.kv_bytes_at_max / GIB:.2f} / "
            f"{d.kv_bytes_at_max / GIB:.2f} GiB a sequence"
        )
        return "\n".join(lines)


def _kv(cfg, dtype: torch.dtype, layers: int, s: PlanSettings) -> tuple[int, int, int, str]:
    per = kv_bytes_per_token(cfg, dtype, layers)
    note = f"{per:,} B/token x {s.max_kv_tokens:,} tokens x {s.batch} sequences"
    return per, per * s.max_kv_tokens, per * s.max_kv_tokens * s.batch, note


def _target_part(name: str, model: PreTrainedModel, s: PlanSettings) -> Part:
    cfg, dtype = model.config, model.dtype
    b, v, act = dtype_bytes(dtype), cfg.vocab_size, activation_bytes_per_row(cfg, dtype)
    prefill = (s.prefill_chunk or s.max_kv_tokens) * act + v * (b + 4)
    verify_rows = s.batch * s.block_size
    verify = verify_rows * (act + v * (b + 4))
    per, at_max, kv, kv_note = _kv(cfg, dtype, cfg.num_hidden_layers, s)
    return Part(
        name=name,
        device=s.device,
        dtype=str(dtype).removeprefix("torch."),
        layers=cfg.num_hidden_layers,
        parameters=sum(p.numel() for p in model.parameters()),
        weight_bytes=param_bytes(model),
        kv_bytes_per_token=per,
        kv_bytes_at_max=at_max,
        kv_bytes=kv,
        workspace_bytes=max(prefill, verify),
        notes={
            "weight_bytes": f"every parameter once x {b} B (meta-device model)",
            "kv_bytes": kv_note,
            "workspace_bytes": f"max(prefill {prefill:,}, verify of {verify_rows} rows {verify:,})",
        },
    )


def _drafter_part(target: PreTrainedModel, s: PlanSettings) -> Part:
    target_cfg = target.config
    dev = s.where_drafter
    dtype = resolve_dtype(s.dtype, dev)
    b = dtype_bytes(dtype)
    own_target_layers = self_layers(s.drafter)
    if own_target_layers is not None:  # the target's layers
        idx = (
            list(range(own_target_layers))
            if isinstance(own_target_layers, int)
            else own_target_layers
        )
        if not idx or any(i < 0 or i >= target_cfg.num_hidden_layers for i in idx):
            raise PlanError(
                f"drafter {s.drafter!r}: layers must lie in [0, {target_cfg.num_hidden_layers})"
            )
        cfg, name, n = target_cfg, s.drafter, len(idx)
        model = target if target.dtype == dtype else meta_lm(target_cfg, dtype)
        mine = nn.ModuleList(
            [*(model.model.layers[i] for i in idx), model.model.norm,
             model.get_input_embeddings(), model.get_output_embeddings()]
        )  # fmt: skip
        params = sum(p.numel() for p in mine.parameters())
        # The own engine's drafter runs on the target's own tensors; beside vLLM the drafter
        # is in a process of its own and holds its layers wherever it is.
        shared = dev == s.device and s.engine == "own"
        weights = 0 if shared else param_bytes(mine)  # a tied head once
        how = "layers shared with the target" if shared else f"{n} layers, norm, embeddings, head"
    else:  # a model of its own
        name, cfg = load_config(s.drafter)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise PlanError(
                f"drafter vocabulary ({cfg.vocab_size}) differs from the target's "
                f"({target_cfg.vocab_size})"
            )
        model = meta_lm(cfg, dtype)
        n = cfg.num_hidden_layers
        params = sum(p.numel() for p in model.parameters())
        weights, how = param_bytes(model), "its own model, every parameter once"
    v_d = s.draft_vocab or cfg.vocab_size
    extra = cfg.hidden_size * b * (1 + (v_d if s.draft_vocab else 0))
    act, k = activation_bytes_per_row(cfg, dtype), s.block_size - 1
    fwd_rows = s.rows * (s.branches + 1) * s.block_size  # blocks + a chain of up to B
    mask = s.rows * (s.branches * s.block_size) * (s.max_kv_tokens + fwd_rows)
    logits = s.rows * s.branches * k * v_d * (b + 4)
    branch = fwd_rows * act + mask + logits
    prompt = (s.prefill_chunk or s.max_kv_tokens) * act + v_d * (b + 4)
    doc = s.document_tokens or s.max_kv_tokens
    reading = int(doc * QUESTION_ROWS) * act  # beside drafting: both count
    per, at_max, kv, kv_note = _kv(cfg, dtype, n, s)
    if dev.startswith("cuda"):  # the packed drafter's slot KV, allocated at the worker's start
        kv = per * DRAFTER_KV_TOKENS
        kv_note = f"{per:,} B/token x {DRAFTER_KV_TOKENS:,} slot positions (all rows, at start)"
    return Part(
        name=name,
        device=dev,
        dtype=str(dtype).removeprefix("torch."),
        layers=n,
        parameters=params,
        weight_bytes=weights + extra,
        kv_bytes_per_token=per,
        kv_bytes_at_max=at_max,
        kv_bytes=kv,
        workspace_bytes=max(branch, prompt) + reading,
        notes={
            "weight_bytes": f"{how} + mask embedding"
            + (f" + {v_d:,} draft-vocabulary head rows" if s.draft_vocab else ""),
            "kv_bytes": kv_note,
            "workspace_bytes": f"max(branch forward {branch:,}: {fwd_rows} rows, mask, "
            f"{s.rows} x {s.branches} x {k} x {v_d:,} logits; prompt {prompt:,}) + /qa reading "
            f"{reading:,} ({doc:,} document tokens x {QUESTION_ROWS} rows, beside drafting)",
            "branch_workspace_bytes": branch,
            "reading_workspace_bytes": reading,
        },
    )


def make_plan(s: PlanSettings) -> Plan:
    """Count a plan's bytes (see the module docstring)."""
    name, cfg = load_config(s.target)
    target = meta_lm(cfg, resolve_dtype(s.dtype, s.device))
    return Plan(s, _target_part(name, target, s), _drafter_part(target, s))


def cmd_plan(args: argparse.Namespace) -> int:
    s = PlanSettings(
        target=args.target,
        drafter=args.drafter,
        dtype=args.dtype,
        batch=args.batch,
        max_kv_tokens=args.max_kv_tokens,
        prefill_chunk=args.prefill_chunk,
        branches=args.branches,
        block_size=args.block_size,
        rows=args.rows,
        draft_vocab=args.draft_vocab,
        device=args.device,
        drafter_device=args.drafter_device,
        engine=args.engine,
        document_tokens=args.document_tokens,
    )
    plan = make_plan(s)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="memory per device of a target and drafter, from their configs alone"
    )
    p.add_argument(
        "--target",
        required=True,
        help="a config.json, a model folder, or a shipped shape: qwen3-8b, qwen3-32b",
    )
    p.add_argument(
        "--drafter", default="self:4", help="self:N, self:i,j,k, or a config of a separate model"
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"]
    )
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--max-kv-tokens", type=int, default=4096, help="KV tokens a sequence")
    p.add_argument("--prefill-chunk", type=int, default=0, help="rows a prefill forward (0: all)")
    p.add_argument("--branches", type=int, default=8, help="branch blocks a drafter forward")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rows", type=int, default=1, help="requests in one branch forward")
    p.add_argument("--draft-vocab", type=int, default=0, help="draft vocabulary (0: all)")
    p.add_argument("--device", default="cuda:0", help="the target's device")
    p.add_argument("--drafter-device", default=None, help="the drafter's (default: --device)")
    p.add_argument(
        "--engine",
        default="own",
        choices=ENGINES,
        help="own: one process; vllm: vLLM's engine core holds the target, a drafter worker the "
        "drafter (never sharing the target's tensors) and the API process no model",
    )
    p.add_argument(
        "--document-tokens",
        type=int,
        default=0,
        help="a /qa document's tokens (0: --max-kv-tokens)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_plan)
