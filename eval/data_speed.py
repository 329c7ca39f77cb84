"""``d3d data`` through the engine against the static batches it used to run, side by side.

The static path (what ``d3d data`` did before): prompts sorted by length, cut into batches of
``--batch`` and answered by Hugging Face ``generate`` with left padding — a batch runs until its
longest answer ends, its finished rows computing padding meanwhile. The engine path (what
``d3d data`` does now, :func:`d3d.training.responses.generate_data`): the scheduler keeps
``--batch`` requests decoding and a new one joins as soon as another finishes.

One run, one process, the same prompts of mixed lengths (the shared general prompt set: code,
passage questions, instructions, word problems) and greedy answers:

1. static batches on plain weights (exactly the old path: ``load_target``, no prepacking);
2. static batches on the engine's own model (weights prepacked for oneDNN), so the ratio
   against it is continuous batching alone;
3. the engine at ``--batch``;
4. the engine one request at a time — its records must equal step 3's.

Prints a table and writes JSON. It times on whatever else the machine runs: for a decision,
run it with nothing else busy (and read the ratios, not the absolute figures)::

    python -m eval.data_speed --n 48 --max-new-tokens 128 --out eval/results/data_speed.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from d3d.config import DecodeConfig, ModelConfig
from d3d.engine import Engine
from d3d.model.load import LoadedModel, load_target
from d3d.training.data import read_many
from d3d.training.responses import DataConfig, generate_data
from d3d.training.sources import Prompt, load_source


def mixed_prompts(n: int, source: str) -> list[Prompt]:
    """``n`` prompts spread over the whole source (its kinds come in runs: take every k-th)."""
    every = load_source(source)
    step = max(1, len(every) // n)
    return every[::step][:n]


@torch.inference_mode()
def static_batches(
    target: LoadedModel, prompts: Sequence[list[int]], batch: int, max_new: int
) -> tuple[dict[int, list[int]], float]:
    """The old path: length-sorted batches through ``generate`` with left padding; each answer
    cut after its first end token. Returns answers by prompt index and the seconds taken."""
    model, eos = target.model, target.eos_token_ids
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else min(eos)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for k in range(0, len(order), batch):
        idx = order[k : k + batch]
        width = max(len(prompts[i]) for i in idx)
        x = torch.full((len(idx), width), pad, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            x[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            attn[row, width - len(prompts[i]) :] = 1
        seqs = model.generate(
            input_ids=x, attention_mask=attn, max_new_tokens=max_new, do_sample=False,
            pad_token_id=pad, eos_token_id=sorted(eos),
        )  # fmt: skip
        for row, i in enumerate(idx):
            ans = seqs[row, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(ans) if t in eos), len(ans))
            out[i] = ans[:cut]
    return out, time.perf_counter() - t0


def engine_run(
    engine: Engine, prompts: list[Prompt], batch: int, max_new: int, folder: Path
) -> tuple[dict[str, list[int]], float]:
    """``d3d data``'s own path at ``batch``; answers by prompt id and the seconds taken."""
    engine = Engine(engine.target, None, engine.model_cfg)  # its scheduler: this batch size
    cfg = DataConfig(max_new_tokens=max_new, batch_size=batch, max_prompt_tokens=1 << 20)
    out = folder / f"engine_b{batch}.jsonl"
    report = generate_data(engine, prompts, out, cfg, progress=False)
    return {r["id"]: r["response_ids"] for r in read_many(out)}, report.seconds


def row(name: str, answers: dict, seconds: float) -> dict:
    tokens = sum(len(a) for a in answers.values())
    return {"path": name, "answers": len(answers), "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.data_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target", default="default")
    p.add_argument("--source", default="general", help="prompt source (d3d.training.sources)")
    p.add_argument("--n", type=int, default=48, help="prompts")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="eval/results/data_speed.json")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    prompts = mixed_prompts(args.n, args.source)
    engine = Engine.from_config(ModelConfig(target=args.target, threads=args.threads),
                                with_drafter=False)  # fmt: skip
    plain = load_target(args.target)
    ids = [q.encode(engine.tokenizer) for q in prompts]
    lengths = sorted(len(i) for i in ids)
    # Nothing timed pays a first forward (page faults, kernels built for new shapes).
    for target in (plain, engine.target):
        static_batches(target, ids[:2], 2, 2)
    engine.generate_ids(ids[0], DecodeConfig(mode="ar", max_new_tokens=2))
    rows, answers = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, target in (("static, plain weights (old d3d data)", plain),
                             ("static, engine's packed weights", engine.target)):  # fmt: skip
            got, s = static_batches(target, ids, args.batch, args.max_new_tokens)
            answers[name] = {prompts[i].id: a for i, a in got.items()}
            rows.append(row(name, answers[name], s))
        for b in (args.batch, 1):
            name = f"engine, batch {b}"
            answers[name], s = engine_run(engine, prompts, b, args.max_new_tokens, Path(tmp))
            rows.append(row(name, answers[name], s))
    base, packed, eng, one = (r["tokens_per_second"] for r in rows)
    e16 = answers[f"engine, batch {args.batch}"]
    same = sum(e16[k] == answers["engine, batch 1"][k] for k in e16)
    static_same = sum(e16[k] == answers[rows[0]["path"]][k] for k in e16)
    report = {
        "target": args.target, "n_prompts": len(prompts), "batch": args.batch,
        "max_new_tokens": args.max_new_tokens, "threads": args.threads,
        "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2],
                          "max": lengths[-1]},
        "rows": rows,
        "engine_vs_static_plain": round(eng / base, 3),
        "engine_vs_static_packed": round(eng / packed, 3),
        "engine_batch_vs_one_at_a_time": round(eng / one, 3),
        "batched_records_equal_one_at_a_time": same == len(e16),
        "records_equal_one_at_a_time": f"{same}/{len(e16)}",
        "records_equal_static": f"{static_same}/{len(e16)}",
    }  # fmt: skip
    print(f"{len(prompts)} prompts ({lengths[0]}-{lengths[-1]} tokens, median "
          f"{lengths[len(lengths) // 2]}), up to {args.max_new_tokens} new tokens, batch "
          f"{args.batch}, {args.threads} thread(s)\n")  # fmt: skip
    print("| path | answers | tokens | seconds | tokens/s |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['answers']} | {r['tokens']} | {r['seconds']} | "
              f"{r['tokens_per_second']} |")  # fmt: skip
    print(f"\nengine / static (plain weights): {report['engine_vs_static_plain']}x; "
          f"engine / static (same packed weights): {report['engine_vs_static_packed']}x; "
          f"batch {args.batch} records equal one-at-a-time: {report['records_equal_one_at_a_time']}"
          f"; equal to static: {report['records_equal_static']}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
