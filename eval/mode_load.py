"""Decoding modes against each other on one ``d3d serve`` under concurrent load: the check that
``auto`` (the default) costs nothing where speculation does not pay.

One server (started with its defaults plus ``--flags``, or the one at ``--url``); the project's
everyday prompts (:data:`eval.serve_load.PROMPTS`) from closed-loop streaming chat clients
(greedy, ``--max-tokens`` new tokens, :func:`eval.vllm_compare.level`), each request asking for
its mode (``extra_body.speculative.mode``). At each level of ``--levels`` every mode of
``--modes`` runs in turn, ``--repeats`` rounds, the order reversed every other round so drift
falls on all alike; reported: each mode's median tok/s, its ratio against ``--base``'s median,
every round's figures, and whether every answer equals the base mode's (greedy decoding is
lossless, so they must). ``--warmup`` unmeasured rounds of every mode come first (one request
per client at the first level), so a fresh server's first-use costs fall on no mode. Writes
``OUT/mode_load.json`` and ``OUT/mode_load.md``.

Usage (it times: run it with nothing else busy):
    python -m eval.mode_load --modes auto,ar --levels 8,16 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from pathlib import Path

from eval.serve_load import PROMPTS, served
from eval.vllm_compare import level, per_client


def measure(
    url: str, modes: list[str], levels: list[int], repeats: int, max_tokens: int, warmup: int = 1
) -> dict:
    """``{level: {mode: [run, ...]}}``, each run :func:`eval.vllm_compare.level`'s result.
    First ``warmup`` unmeasured rounds of every mode at the first level: a fresh server builds
    what each new forward width needs on first use (oneDNN primitives, the chat head's cache
    entry), which would otherwise fall on whichever mode runs first."""
    for _ in range(warmup):
        for mode in modes:
            asyncio.run(level(url, PROMPTS, levels[0], 1, max_tokens, mode))
    out: dict = {}
    for c in levels:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                n = per_client(c, len(PROMPTS))
                lv = asyncio.run(level(url, PROMPTS, c, n, max_tokens, mode))
                runs[mode].append(lv)
                print(f"  {c:3d} clients, {mode}: {lv['tokens_per_s']:.1f} tok/s", flush=True)
        out[c] = runs
    return out


def summary(runs: dict, base: str) -> dict:
    """Per level: each mode's median tok/s, its ratio against ``base``, every round's figure,
    and (answers equal to base's, answers compared)."""
    out = {}
    for c, by_mode in runs.items():
        med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in by_mode.items()}
        ref = {p: t for r in by_mode[base] for p, t in r["texts"].items()}
        same = {
            m: (
                sum(t == ref.get(p) for r in rs for p, t in r["texts"].items()),
                sum(len(r["texts"]) for r in rs),
            )
            for m, rs in by_mode.items()
        }
        out[str(c)] = {
            "median": med,
            "ratio": {m: v / med[base] for m, v in med.items()},
            "rounds": {m: [r["tokens_per_s"] for r in rs] for m, rs in by_mode.items()},
            "failed": {m: sum(r["requests"] - r["ok"] for r in rs) for m, rs in by_mode.items()},
            "identical": same,
        }
    return out


def table(summ: dict, base: str) -> str:
    modes = list(next(iter(summ.values()))["median"])
    rows = [
        "| clients | "
        + " | ".join(f"{m} tok/s" for m in modes)
        + " | rounds | identical | failed |",
        "|---:|" + "---:|" * len(modes) + "---|---|---:|",
    ]
    for c, s in summ.items():
        cells = [
            f"{s['median'][m]:.1f}" + (f" ({s['ratio'][m]:.3f}x)" if m != base else "")
            for m in modes
        ]
        rounds = "; ".join(f"{m} " + " / ".join(f"{x:.1f}" for x in s["rounds"][m]) for m in modes)
        same = ", ".join(f"{m} {a}/{b}" for m, (a, b) in s["identical"].items() if m != base)
        rows.append(
            f"| {c} | "
            + " | ".join(cells)
            + f" | {rounds} | {same} | {sum(s['failed'].values())} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="eval/results/mode_load")
    p.add_argument("--modes", default="auto,ar")
    p.add_argument("--base", default="ar", help="the mode the others are compared with")
    p.add_argument("--levels", default="8,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--warmup", type=int, default=1, help="unmeasured rounds of every mode first (0: none)"
    )
    p.add_argument("--url", default="", help="a running server instead of starting one")
    p.add_argument("--port", type=int, default=8961)
    p.add_argument("--flags", default="", help="d3d serve's flags besides --port")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if args.base not in modes:
        p.error(f"--base {args.base!r} is not one of --modes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.levels.split(",")]
    with contextlib.ExitStack() as stack:
        url = (
            args.url
            or stack.enter_context(served(args.flags.split(), args.port, out / "server.log")).url
        )
        runs = measure(url, modes, levels, args.repeats, args.max_tokens, args.warmup)
    summ = summary(runs, args.base)
    command = "python -m eval.mode_load " + " ".join(argv if argv is not None else sys.argv[1:])
    text = f"Command: `{command}`\n\n{table(summ, args.base)}\n"
    (out / "mode_load.md").write_text(text)
    (out / "mode_load.json").write_text(json.dumps({"command": command, "summary": summ}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
