"""``d3d data``: the target's own greedy responses as drafter training data.

Thin: flags into :class:`~d3d.training.responses.DataConfig` and a responder, then
:func:`~d3d.training.responses.generate_data`. ``--engine own`` decodes with the engine's
scheduler (under torchrun, one shard per process and GPU); ``--engine vllm`` with vLLM
(:mod:`d3d.training.vllm_responses`), and ``--gpus N`` then starts N processes, one per GPU (each sees only its
own, ``CUDA_VISIBLE_DEVICES``) writing shard i of N: vLLM runs its own processes and does not
run under torchrun. ``--text-source`` writes teacher-forced records instead (no generation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from d3d.cli import add_model_args, model_config


def cmd_data(args: argparse.Namespace) -> int:
    from d3d.engine import Engine
    from d3d.training import contamination
    from d3d.training.data import write_heldout_prompts
    from d3d.training.parallel import from_env
    from d3d.training.responses import DataConfig, Shard, generate_data
    from d3d.training.sources import DEFAULT_MIX, prompt_mix

    if args.text_source:
        return _text_data(args)
    cfg = DataConfig(
        heldout_fraction=args.heldout_fraction,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        topk=args.keep_topk,
        allow_eval=args.allow_eval_sources,
    )
    if args.engine == "vllm" and cfg.topk:
        raise ValueError("--keep-topk: soft labels come from the own engine (--engine own)")
    if args.gpus > 1:
        return _per_gpu(args)
    sources = [*(args.sources or []), *(f"jsonl:{p}" for p in args.prompts or [])]
    prompts = prompt_mix(sources or DEFAULT_MIX)
    shard, rank = Shard.parse(args.shard), from_env()
    mcfg = model_config(args)
    if rank.enabled and mcfg.target_device.startswith("cuda"):  # torchrun: a shard per GPU
        mcfg = dataclasses.replace(mcfg, target_device=f"cuda:{rank.local_rank}")
    if args.engine == "vllm":
        from d3d.training.vllm_responses import VllmResponder

        eager = args.vllm_eager or not mcfg.target_device.startswith("cuda")
        source = VllmResponder(mcfg, cfg.batch_size, eager=eager)
    else:
        source = Engine.from_config(mcfg, with_drafter=False)
    report = generate_data(source, prompts, args.out, cfg, shard, contamination.default_index(),
                           progress=not args.quiet)  # fmt: skip
    out = report.to_dict()
    if args.heldout_prompts and shard.count == 1:
        out["heldout_prompts"] = write_heldout_prompts(args.out, args.heldout_prompts)
    print(json.dumps(out))
    return 0


def _per_gpu(args: argparse.Namespace) -> int:
    """``--engine vllm --gpus N``: N processes, GPU i writing shard i of N; their reports."""
    if args.engine != "vllm" or args.shard is not None:
        raise ValueError("--gpus: with --engine vllm and no --shard (the own engine: torchrun)")
    procs = [
        subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
        for env, cmd in shard_commands(args.argv, args.gpus)
    ]
    reports, failed = [], []
    for i, proc in enumerate(procs):
        out, _ = proc.communicate()
        lines = [x for x in out.splitlines() if x.startswith('{"out"')]
        if proc.returncode or not lines:
            failed.append(i)
        else:
            reports.append(json.loads(lines[-1]))
    print(json.dumps({"shards": reports, "failed_shards": failed}))
    return 1 if failed else 0


def shard_commands(argv: list[str], gpus: int) -> list[tuple[dict[str, str], list[str]]]:
    """The environment and command of each GPU's process: ``argv`` without ``--gpus``, writing
    shard i of ``gpus`` on the one GPU it sees (``cuda``)."""
    base, skip = [], False
    for a in argv:
        if skip or a.startswith("--gpus="):
            skip = False
            continue
        skip = a == "--gpus"
        if not skip:
            base.append(a)
    return [
        ({"CUDA_VISIBLE_DEVICES": str(i)},
         [sys.executable, "-m", "d3d", *base, "--shard", f"{i}/{gpus}", "--device", "cuda"])
        for i in range(gpus)
    ]  # fmt: skip


def _text_data(args: argparse.Namespace) -> int:
    """Teacher-forced records (existing replies, tokenized; no generation)."""
    from d3d.model.load import load_text
    from d3d.training import contamination
    from d3d.training.teacher import sharegpt_items, write_text_records

    name, _, limit = args.text_source.partition("@")
    if name != "sharegpt":
        raise ValueError(f"unknown text source {name!r}: use sharegpt[@N]")
    tokenizer = load_text(model_config(args).target).tokenizer
    t0 = time.perf_counter()
    items = sharegpt_items(int(limit) if limit else None)
    if not args.allow_eval_sources:  # the eval-set guard, as for generated records
        index = contamination.default_index()
        items = [it for it in items if index.match(it[2]) is None]
    n = write_text_records(tokenizer, items, args.out, max_reply_tokens=args.max_new_tokens,
                           heldout_fraction=args.heldout_fraction)  # fmt: skip
    print(json.dumps({"out": args.out, "written": n, "seconds": round(time.perf_counter() - t0)}))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="generate the target's own responses as training data")
    p.add_argument("--out", required=True, help="jsonl file (appended to; reruns resume)")
    p.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        help="prompt file(s): jsonl with 'prompt' or chat 'messages' (optional 'id', 'source'), "
        "or one prompt per line",
    )
    p.add_argument("--sources", nargs="+", default=None, help="prompt sources, e.g. general@300")
    p.add_argument("--heldout-fraction", type=float, default=0.08)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    p.add_argument(
        "--batch-size", type=int, default=16, help="requests decoding at once (continuous batching)"
    )
    p.add_argument(
        "--shard",
        default=None,
        help="i/n: generate shard i of n (its own file, OUT.shard-i-of-n.jsonl); under torchrun "
        "each rank takes its own shard",
    )
    p.add_argument(
        "--allow-eval-sources",
        action="store_true",
        help="also answer prompts from or found in an evaluation set (labelled eval_set)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--heldout-prompts", default=None, help="also write the held-out prompts here")
    p.add_argument(
        "--engine",
        choices=["own", "vllm"],
        default="own",
        help="what decodes: the own engine's scheduler, or vLLM (its batching and, on a GPU, "
        "its kernels; the same greedy records; needs vLLM installed)",
    )
    p.add_argument(
        "--vllm-eager",
        action="store_true",
        help="--engine vllm: no compilation or graphs on a GPU (starts faster; always so on CPU)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="--engine vllm: one process per GPU, GPU i writing shard i of N (the own engine: "
        "torchrun --nproc_per_node N)",
    )
    p.add_argument("--keep-topk", type=int, default=0,
                   help="also store the target's top-k log-probs per response token")  # fmt: skip
    p.add_argument(
        "--text-source",
        default=None,
        help="write teacher-forced records from existing replies instead (sharegpt[@N]; local "
        "use only) — no generation, soft labels come from the target at training time",
    )
    add_model_args(p)
    p.set_defaults(func=cmd_data)
