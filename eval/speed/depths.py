"""``d3d eval depths``: what drafter depth the asynchronous mode wants on this host.

Once drafting is hidden beside verification, a deeper drafter costs nothing until its forward
no longer fits inside the verify forward; but on a CPU a forward costs about its token count,
so every layer added also shrinks how many branches fit (the budget of
:mod:`d3d.worker.budget`), and fewer branches mean fewer hits. For each drafter spec this
measures, in one process with interleaved repeats: the block forward over the verify forward,
the branch forwards for 1, 2, 4 branches and how many fit in 85% of a verify; then decodes the
same prompts with ``ar`` and ``async`` (drafter in its own process) for acceptance length, hit
rate and tokens/s. Results: JSON, a Markdown table and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from d3d.backends.hf import trim_cache, with_cache
from d3d.cli import add_model_args, model_config
from d3d.config import DecodeConfig
from d3d.worker.drafting import draft_branches

SAFETY = 0.85


@torch.inference_mode()
def forward_costs(target, drafter, context: int, repeats: int) -> dict:
    """Median ms of step, verify, drafter block and branch forwards (1, 2, 4), interleaved."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, context), generator=gen)
    t_cache, d_cache = DynamicCache(), DynamicCache()
    target(input_ids=ids, **with_cache(target, t_cache))
    drafter.encode(ids[0].tolist(), d_cache)
    b = drafter.block_size

    def tgt(n: int) -> None:
        pos = torch.arange(context, context + n).unsqueeze(0)
        target(input_ids=ids[:, :n], position_ids=pos, **with_cache(target, t_cache))
        trim_cache(t_cache, n)

    def branches(n: int) -> None:  # a 2-token chain (k <= 1 outcomes) plus n blocks
        chain = ids[0, :2].tolist()
        draft_branches(
            drafter, d_cache, [context + k % 2 + 1 for k in range(n)], chain[:1] * n, chain
        )
        trim_cache(d_cache, 2)

    jobs = {
        "step": lambda: tgt(1),
        "verify": lambda: tgt(b),
        "block": lambda: drafter.block_scores(int(ids[0, -1]), d_cache),
        **{f"branches_{n}": (lambda n=n: branches(n)) for n in (1, 2, 4)},
    }
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for fn in jobs.values():
        fn()
    for _ in range(repeats):
        for k, fn in jobs.items():
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    # t(n) = a + b n through the 1- and 4-branch points; the most branches inside the budget
    per = (med["branches_4"] - med["branches_1"]) / 3
    fixed = med["branches_1"] - per
    fit = int((SAFETY * med["verify"] - fixed) // per) if per > 0 else 0
    med["block_over_verify"] = round(med["block"] / med["verify"], 3)
    med["branches_that_fit"] = max(0, fit)
    return med


def run_depths(args: argparse.Namespace) -> list[dict]:
    from d3d.engine import Engine
    from eval.speed.methods import ALL_CORES, set_cpu

    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()]
    prompts = prompts[: args.n]
    rows = []
    for spec in [s for s in args.drafters.split(",") if s]:
        mcfg = model_config(args)
        engine = Engine.from_config(
            type(mcfg)(**{**vars(mcfg), "drafter": spec}), start_worker=len(ALL_CORES) > 1
        )
        try:
            set_cpu(engine, "one")
            row = {"drafter": spec, "layers": len(engine.drafter.meta.layers)}
            row.update(
                forward_costs(engine.target.model, engine.drafter, args.context, args.repeats)
            )
            tot = {"ar": [0, 0.0], "async": [0, 0.0]}
            acc = [0, 0, 0, 0]  # drafts, accepted, hits, misses
            for p in prompts:
                ids = engine.encode(p)
                for mode in ("ar", "async"):
                    set_cpu(engine, "one" if mode == "ar" else "pinned")
                    s = engine.generate_ids(
                        ids, DecodeConfig(mode=mode, max_new_tokens=args.max_new_tokens)
                    ).stats
                    tot[mode][0] += s.num_tokens - 1
                    tot[mode][1] += s.decode_seconds
                    if mode == "async":
                        acc = [
                            acc[0] + s.num_drafts,
                            acc[1] + s.num_accepted_tokens,
                            acc[2] + s.branch_hits,
                            acc[3] + s.branch_misses,
                        ]
            ar_tps = tot["ar"][0] / tot["ar"][1]
            as_tps = tot["async"][0] / tot["async"][1]
            row.update(
                acceptance_length=round(1 + acc[1] / max(acc[0], 1), 3),
                hit_rate=round(acc[2] / max(acc[2] + acc[3], 1), 3),
                ar_tokens_per_s=round(ar_tps, 2),
                async_tokens_per_s=round(as_tps, 2),
                async_over_ar=round(as_tps / ar_tps, 3),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            engine.close()
    return rows


def write(rows: list[dict], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "depths.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    lines = [
        f"Command: `{command}`",
        "",
        "| drafter | layers | block ms | verify ms | block / verify | branches that fit | acceptance length | hit rate | async tok/s | ar tok/s | async / ar |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['drafter']} | {r['layers']} | {r['block']:.1f} | {r['verify']:.1f} | "
            f"{r['block_over_verify']:.2f} | {r['branches_that_fit']} | {r['acceptance_length']:.2f} | "
            f"{r['hit_rate']:.0%} | {r['async_tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | "
            f"{r['async_over_ar']:.2f} |"
        )
    (out / "depths.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["layers"] for r in rows]
    ax.plot(xs, [r["block_over_verify"] for r in rows], "o-", label="block / verify")
    ax.plot(xs, [r["hit_rate"] for r in rows], "s-", label="hit rate")
    ax.plot(xs, [r["async_over_ar"] for r in rows], "^-", label="async / ar tokens/s")
    ax.set_xlabel("drafter layers")
    ax.legend()
    ax.set_title("Drafter depth on this CPU")
    fig.tight_layout()
    fig.savefig(out / "depths.png", dpi=110)
    plt.close(fig)


def cmd_depths(args: argparse.Namespace) -> int:
    import sys

    rows = run_depths(args)
    write(rows, Path(args.out), "d3d " + " ".join(sys.argv[1:]))
    print((Path(args.out) / "depths.md").read_text())
    return 0


def register_depths(inner: argparse._SubParsersAction) -> None:
    p = inner.add_parser("depths", help="drafter depth vs block cost, branches and async speed")
    p.add_argument("--drafters", default="self:4,default,self:12,self:18,self:24")
    p.add_argument("--prompts", default="d3d/checkpoints/smollm2-135m/heldout_prompts.jsonl")
    p.add_argument("--n", type=int, default=4, help="prompts to decode per drafter")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="runs/depths")
    add_model_args(p)
    p.set_defaults(func=cmd_depths)
