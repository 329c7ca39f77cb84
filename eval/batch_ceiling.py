"""The most continuous batching can give on this host: the load test's ratio, bounded from the
engine's own forward costs.

The load test (:mod:`eval.serve_load`) reports aggregate tokens/s at C clients over one client.
On a CPU the ratio is capped by how a forward's time grows with its rows: fitted as
``t(n) = a + b n`` over n one-token rows (a: reading the weights and the per-step work, b: a
row's own compute), one client pays ``a + b`` a token, C rows in lockstep ``a / C + b``. This
script times the engine's :class:`~d3d.backends.target.BatchTarget` (the service's forward: packed
weights, rows in KV slabs, one ragged forward) on C decoding rows at the load test's lengths,
and a prompt read alone and all C prompts in one forward, and reports the ceiling

    ceiling(C) = C * (prefill(P) + (G - 1) t(1)) / (prefill(C x P) + (G - 1) t(C)),

every request reading a P-token prompt and generating G tokens, C of them in perfect lockstep
(no arrival ramp, no tail, no HTTP, no scheduling): what the load test could reach at best. It
times: run it with nothing else busy on the machine.

    python -m eval.batch_ceiling --out eval/results/serve [--threads 2] [--clients 16,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from d3d.backends.target import BatchTarget
from d3d.config import ModelConfig
from d3d.engine import Engine
from d3d.engine.calibration import median_seconds
from eval.serve_load import PROMPTS


def decode_cost(target: BatchTarget, rows: int, context: int, repeats: int) -> float:
    """Median seconds of one forward of ``rows`` one-token rows, each after ``context`` tokens
    (nothing committed, so every repeat sees the same lengths)."""
    kv = target.kv
    opened = [kv.open(context + 8) for _ in range(rows)]
    try:
        for r in opened:
            target.forward([r], [[1] * context], [[]])
            kv.commit(r, context)
        target.forward(opened, [[2]] * rows, None)  # warm
        return median_seconds(
            lambda: target.forward(opened, [[2]] * rows, None), target.clock, repeats
        )
    finally:
        for r in opened:
            kv.close(r)


def prefill_cost(target: BatchTarget, prompts: list[list[int]], repeats: int) -> float:
    """Median seconds of one forward reading every prompt (a row each), logits of the last."""
    kv = target.kv

    def once() -> None:
        opened = [kv.open(len(p) + 8) for p in prompts]
        try:
            target.forward(opened, prompts, [[len(p) - 1] for p in prompts])
        finally:
            for r in opened:
                kv.close(r)

    once()
    return median_seconds(once, target.clock, repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.batch_ceiling", description=__doc__)
    p.add_argument("--target", default="default", help="a model id or path (default: embedded)")
    p.add_argument("--out", default="eval/results/serve")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="16,64")
    p.add_argument("--max-tokens", type=int, default=64, help="G: tokens a request generates")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_config(ModelConfig(args.target), with_drafter=False)
    target = engine.scheduler().target
    prompts = [engine.encode(q) for q in PROMPTS]
    plen = round(statistics.mean(map(len, prompts)))
    g = args.max_tokens
    context = plen + g // 2  # a decoding row's mean length over its answer
    sizes = sorted({1, 2, 4, 8, *(int(c) for c in args.clients.split(","))})
    steps = {n: decode_cost(target, n, context, args.repeats) for n in sizes}
    b, a = statistics.linear_regression(list(steps), list(steps.values()))
    alone = statistics.median(prefill_cost(target, [q], args.repeats) for q in prompts[:4])
    one = alone + (g - 1) * steps[1]
    out = {
        "command": "python -m eval.batch_ceiling " + " ".join(argv or sys.argv[1:]),
        "threads": args.threads,
        "prompt_tokens": plen,
        "generated_tokens": g,
        "decode_context": context,
        "step_s": {str(n): round(s, 5) for n, s in steps.items()},
        "fit_a_s": round(a, 5),
        "fit_b_s": round(b, 5),
        "prefill_alone_s": round(alone, 5),
        "ceilings": {},
    }
    for c in (int(x) for x in args.clients.split(",")):
        batch = [prompts[i % len(prompts)] for i in range(c)]
        together = prefill_cost(target, batch, max(3, args.repeats // 3))
        ceiling = c * one / (together + (g - 1) * steps[c])
        out["ceilings"][str(c)] = {
            "prefill_together_s": round(together, 4),
            "decode_only": round(c * steps[1] / steps[c], 2),
            "with_prompts": round(ceiling, 2),
        }
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "batch_ceiling.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
