"""``d3d train``, ``d3d prune``, ``d3d accept`` and ``d3d drafter-eval`` (``d3d data``:
:mod:`.data_cli`).

Thin wrappers: parse flags into the frozen configs of :mod:`d3d.training` and call it. Every
command takes the shared model flags (``--target``, ``--threads``, ``--device``, ...); for
``train`` ``--init MODEL`` starts from another pretrained model with the target's tokenizer
(:mod:`.init`), else ``--drafter`` names the start (default ``self:8``: the target's first 8
layers; ``lora:N[:RANK]`` its first N layers frozen with gated adapters; a checkpoint to
continue), for ``prune`` and ``accept`` the trained checkpoint.

``train`` and ``data`` run under torchrun too (``torchrun --nproc_per_node N -m d3d train ...``):
``train`` then trains one model data-parallel (:mod:`.parallel`), ``data`` writes one shard per
process. Only rank 0 prints the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from d3d.cli import add_model_args, model_config
from d3d.training import data_cli

DEFAULT_INIT = "self:8"


def _load(
    args: argparse.Namespace,
    drafter_spec: str | None,
    device: str | None = None,
    adapter_rank: int = 0,
):
    """The target (and a drafter when ``drafter_spec``) on the configured device and threads
    (``device``: both on this one, a torchrun rank's). A drafter initialised from another
    model needs of its target only the vocabulary, the dtype and the tokenizer: the target's
    layers are not read then (a 32B target is not loaded beside every rank's drafter)."""
    from d3d.engine import check_device
    from d3d.model.load import load_target
    from d3d.training.init import init_drafter, init_spec

    mcfg = model_config(args)
    if device is not None:
        mcfg = dataclasses.replace(mcfg, target_device=device, drafter_device=device)
    check_device(mcfg.target_device)
    if mcfg.threads:
        torch.set_num_threads(mcfg.threads)
    if drafter_spec is not None and init_spec(drafter_spec) is not None:
        target = _target_outline(mcfg)
    else:
        target = load_target(mcfg.target, device=mcfg.target_device, dtype=mcfg.dtype)
    drafter = None
    if drafter_spec:
        drafter = init_drafter(drafter_spec, target, mcfg.resolved_drafter_device, adapter_rank)
    return target, drafter


def _target_outline(mcfg):
    """The target's embeddings, LM head, final norm and tokenizer; its layers stay unread."""
    from transformers import AutoTokenizer

    from d3d.model.load import LoadedModel, load_target_part, local_folder

    part = load_target_part(mcfg.target, lambda depth: (), mcfg.target_device, mcfg.dtype)
    folder = local_folder(mcfg.target)
    has_tok = folder is not None and (folder / "tokenizer_config.json").is_file()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder if has_tok else mcfg.target)
    except (OSError, ValueError):
        tokenizer = None  # nothing to check the initial model's tokenizer against
    return LoadedModel(part.model, tokenizer, mcfg.target)


def _records(args: argparse.Namespace):
    """The training and validation records of ``--data``, checked (:mod:`.inputs`)."""
    from d3d.training.inputs import load_training_data

    return load_training_data(args.data, args.val_seqs, args.allow_eval_sources)


def _gamma(text: str) -> float | None:
    return None if text.lower() in ("none", "uniform") else float(text)


def _train_config(args: argparse.Namespace, steps: int, save_every: int):
    from d3d.training.objectives import LossConfig
    from d3d.training.train import TrainConfig

    loss = LossConfig(gamma=args.gamma, ntp_weight=args.ntp_weight, anchors_per_seq=args.anchors,
                      kl_weight=args.kl_weight, topk=args.topk)  # fmt: skip
    return TrainConfig(
        steps=steps,
        lr=args.lr,
        warmup=args.warmup,
        grad_accum=args.grad_accum,
        max_len=args.max_len,
        loss=loss,
        val_every=args.val_every,
        val_stride=args.val_stride,
        save_every=save_every,
        seed=args.seed,
        grad_checkpointing=getattr(args, "grad_checkpointing", False),
        parallel=getattr(args, "parallel", "ddp"),
        keep_every=getattr(args, "keep_every", 0),
    )


def _init_spec(args: argparse.Namespace) -> str:
    if args.init and args.drafter:
        raise ValueError("train: give --init MODEL or --drafter SPEC, not both")
    return f"init:{args.init}" if args.init else (args.drafter or DEFAULT_INIT)


def cmd_train(args: argparse.Namespace) -> int:
    from d3d.training import parallel
    from d3d.training.train import train

    cfg = _train_config(args, args.steps, args.save_every)
    data = _records(args)
    rank, device = parallel.start(model_config(args).target_device)
    try:
        target, drafter = _load(args, _init_spec(args), device if rank.enabled else None,
                                args.adapter_rank)  # fmt: skip
        data.check_tokenizer(target)
        if args.draft_vocab is not None:
            from d3d.training.data import draft_vocabulary

            ids = None
            if args.draft_vocab > 0:
                ids = draft_vocabulary(data.train, args.draft_vocab, target.eos_token_ids)
            drafter.set_draft_vocab(ids)
        result = train(drafter, data.train, cfg, args.out, data.val, resume=not args.no_resume,
                       progress=not args.quiet, dist=rank)  # fmt: skip
        if not rank.main:
            return 0
        final = Path(args.out) / "final"
        report = {
            "out": str(final),
            "steps": result.steps,
            "loss": None if math.isnan(result.loss) else round(result.loss, 4),  # no step run
            "val": result.val,
            "seconds": round(result.seconds),
            "world": rank.world,
        }
        if args.export:
            from d3d.model.drafter import D3DDrafter
            from d3d.training.train import save_compact

            # From the saved final checkpoint: a sharded run's drafter holds only its shards.
            done = D3DDrafter.load(final, target.model, device="cpu")
            dtype = getattr(torch, args.export_dtype)
            report["export"] = str(save_compact(done, args.export, dtype))
        print(json.dumps(report))
        return 0
    finally:
        parallel.stop()


def cmd_prune(args: argparse.Namespace) -> int:
    from d3d.training.prune import PruneConfig, markdown_table, prune

    if not args.drafter:
        raise ValueError("prune needs --drafter CHECKPOINT (a trained drafter)")
    cfg = PruneConfig(
        min_layers=args.min_layers,
        max_stages=args.max_stages,
        patience=args.patience,
        recovery=_train_config(args, args.recovery_steps, args.recovery_steps),
        val_stride=args.val_stride,
    )
    data = _records(args)
    target, drafter = _load(args, args.drafter)
    data.check_tokenizer(target)
    stages, chosen = prune(drafter, target.model, data.train, data.val, cfg, args.out)
    chosen.save(Path(args.out) / "chosen")
    if args.export:
        from d3d.training.train import save_compact

        save_compact(chosen, args.export, getattr(torch, args.export_dtype))
    print(markdown_table(stages, max(stages, key=lambda s: s.estimated_speedup).stage))
    return 0


def cmd_accept(args: argparse.Namespace) -> int:
    from d3d.training.accept import offline_acceptance
    from d3d.training.data import read_many
    from d3d.training.inputs import check_tokenizer

    records = read_many(args.data, args.split)
    if args.ids:
        # Score the records named (in order) by a prompt file, e.g. the held-out prompts file.
        by_id = {r["id"]: r for r in records}
        wanted = [json.loads(x)["id"] for x in Path(args.ids).read_text().splitlines() if x.strip()]
        records = [by_id[i] for i in wanted if i in by_id]
    records = records[: args.limit or None]
    target, drafter = _load(args, args.drafter or "default")
    check_tokenizer(records, target, ", ".join(args.data))
    t0 = time.perf_counter()
    acc = offline_acceptance(drafter, records, mode=args.mode, stride=args.stride,
                             max_response=args.max_new_tokens)  # fmt: skip
    out = {"n_records": len(records), "mode": args.mode, **acc.to_dict()}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


def cmd_drafter_eval(args: argparse.Namespace) -> int:
    from d3d.engine import Engine
    from d3d.training.evaluate import evaluate, read_prompts

    prompts = read_prompts(args.prompts, args.limit)
    engine = Engine.from_config(model_config(args))
    report = evaluate(engine, prompts, args.max_new_tokens, progress=not args.json)
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>26}: {v}")
    return 0


def _train_flags(p: argparse.ArgumentParser, steps: int) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--data", required=True, nargs="+", help="jsonl file(s) written by `d3d data`")
    g.add_argument("--steps", type=int, default=steps)
    g.add_argument("--lr", type=float, default=5e-4)
    g.add_argument("--warmup", type=int, default=10)
    g.add_argument("--grad-accum", type=int, default=4, help="sequences per optimizer step")
    g.add_argument("--max-len", type=int, default=320, help="window of prompt + response tokens")
    g.add_argument("--gamma", type=_gamma, default=5.0, help="position decay; 'none' = uniform")
    g.add_argument("--ntp-weight", type=float, default=0.5, help="weight of the next-token loss")
    g.add_argument("--kl-weight", type=float, default=0.0, help="weight of the soft-label loss")
    g.add_argument("--topk", type=int, default=8, help="teacher top-k of the soft labels")
    g.add_argument(
        "--allow-eval-sources",
        action="store_true",
        help="train on evaluation-set records too (HumanEval, GSM8K, MT-Bench, AIME25)",
    )
    g.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    g.add_argument("--val-seqs", type=int, default=None,
                   help="training records set aside for validation (default 12, at most a "
                   "quarter of them)")  # fmt: skip
    g.add_argument("--val-every", type=int, default=50)
    g.add_argument("--val-stride", type=int, default=8)
    g.add_argument("--seed", type=int, default=0)


def _export_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--export", default=None, help=f"also save {what} here (compact dtype)")
    p.add_argument("--export-dtype", default="float16", choices=["float16", "bfloat16", "float32"])


def register(sub: argparse._SubParsersAction) -> None:
    data_cli.register(sub)

    p = sub.add_parser("train", help="train a drafter on target responses (resumable)")
    p.add_argument("--out", required=True, help="run folder (checkpoints, log.jsonl, final/)")
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--no-resume", action="store_true", help="ignore OUT/last")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="restrict drafting to the N tokens most frequent in the training responses "
        "(0: whole vocabulary; default: keep the initial drafter's; a resumed run keeps its own)",
    )
    p.add_argument(
        "--init",
        default=None,
        help="start from this pretrained causal LM (HF id or folder) with the target's tokenizer, "
        "any width and depth (instead of --drafter)",
    )
    p.add_argument(
        "--adapter-rank",
        type=int,
        default=0,
        help="with --init: train gated adapters of this rank on its frozen layers (0: train it "
        "in full, the default)",
    )
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"],
                   help="under torchrun: ddp, or fsdp (layers sharded: drafters that do not fit "
                   "one GPU)")  # fmt: skip
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="recompute each layer's activations in the backward pass (long windows, big drafters)",
    )
    p.add_argument("--keep-every", type=int, default=0, help="also keep OUT/step_K every K steps")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _export_flags(p, "the trained drafter")
    _train_flags(p, steps=300)
    add_model_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prune", help="progressive layer pruning of a trained drafter")
    p.add_argument("--out", required=True, help="folder for stages, table and plot")
    p.add_argument("--min-layers", type=int, default=2)
    p.add_argument("--max-stages", type=int, default=4)
    p.add_argument("--patience", type=int, default=1)
    p.add_argument("--recovery-steps", type=int, default=30)
    _export_flags(p, "the chosen drafter")
    _train_flags(p, steps=30)
    add_model_args(p)
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("accept", help="offline acceptance length on target responses")
    p.add_argument("--data", required=True, nargs="+", help="jsonl file(s) from `d3d data`")
    p.add_argument("--split", default="heldout", choices=["heldout", "train"])
    p.add_argument("--mode", default="rounds", choices=["rounds", "stride"])
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--ids", default=None, help="jsonl with 'id': score these records, in order")
    p.add_argument("--max-new-tokens", type=int, default=None, help="score only this many")
    add_model_args(p)
    p.set_defaults(func=cmd_accept)

    p = sub.add_parser("drafter-eval", help="sync vs ar greedy decoding on held-out prompts")
    p.add_argument("--prompts", default=None, help="jsonl with 'prompt' or one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(p)
    p.set_defaults(func=cmd_drafter_eval)
