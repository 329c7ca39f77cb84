"""Two checkouts of this project, the same ``d3d generate`` side by side: is anything slower?

Runs ``python -m d3d generate PROMPT --json`` from checkout A and checkout B alternately
(``--repeats`` times each, every prompt, every mode), each in a fresh process with the same
flags, and reports per mode the median decode tokens/s of each, the ratio B / A, and whether
the two produced the same token ids. A fresh process per run measures what a user's command
gets, loading included in nothing (decode seconds only).

    git worktree add /tmp/before <commit>
    python -m eval.ab_checkouts --a /tmp/before --b . --modes ar,auto --out eval/results/ab
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "Give three tips for writing clear emails.",
]


def run(checkout: Path, prompt: str, mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "d3d", "generate", prompt, "--json", "--mode", mode]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), *args.extra]
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    out = subprocess.run(
        cmd, cwd=checkout, env=env, capture_output=True, text=True, check=True, timeout=900
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.ab_checkouts", description=__doc__)
    p.add_argument("--a", required=True, help="the baseline checkout")
    p.add_argument("--b", default=".", help="the checkout under test")
    p.add_argument("--modes", default="ar,auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more flags for d3d generate (after --)")
    args = p.parse_args(argv)
    a, b = Path(args.a), Path(args.b)
    report: dict = {"command": "python -m eval.ab_checkouts " + " ".join(argv or sys.argv[1:])}
    for mode in args.modes.split(","):
        rates: dict[str, list[float]] = {"a": [], "b": []}
        same = True
        for _ in range(args.repeats):
            for prompt in PROMPTS:
                ra, rb = run(a, prompt, mode, args), run(b, prompt, mode, args)
                rates["a"].append(ra["tokens_per_second"])
                rates["b"].append(rb["tokens_per_second"])
                same &= ra["token_ids"] == rb["token_ids"]
        med = {k: statistics.median(v) for k, v in rates.items()}
        report[mode] = {
            "a_tokens_per_s": med["a"],
            "b_tokens_per_s": med["b"],
            "b_over_a": med["b"] / med["a"],
            "identical": same,
            "runs": rates,
        }
        print(
            f"{mode}: A {med['a']:.2f} tok/s, B {med['b']:.2f} tok/s, B/A {med['b'] / med['a']:.3f}, identical {same}",
            flush=True,
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ab.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
