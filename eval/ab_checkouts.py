"""Two checkouts of this project, the same ``d3d generate`` side by side: is anything slower?

Runs ``python -m d3d generate PROMPT --json`` from checkout A and checkout B alternately
(``--repeats`` times each, every prompt, every mode, interleaved), each in a fresh process with
the same flags, and reports per mode the median decode tokens/s of each, the ratio B / A,
whether the two produced the same token ids, and in each checkout every mode against the first
as the median of run-by-run ratios (``auto`` / ``ar`` on the same prompt, run one after the
other). A fresh process per run measures what a user's command
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
    modes = args.modes.split(",")
    report: dict = {"command": "python -m eval.ab_checkouts " + " ".join(argv or sys.argv[1:])}
    # Interleaved: every (repeat, prompt) runs each mode in A then B back to back, so a drift of
    # the machine's speed falls on both sides and on every mode alike.
    rates = {m: {"a": [], "b": []} for m in modes}
    same = dict.fromkeys(modes, True)
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            for mode in modes:
                ra, rb = run(a, prompt, mode, args), run(b, prompt, mode, args)
                rates[mode]["a"].append(ra["tokens_per_second"])
                rates[mode]["b"].append(rb["tokens_per_second"])
                same[mode] &= ra["token_ids"] == rb["token_ids"]
    for mode in modes:
        med = {k: statistics.median(v) for k, v in rates[mode].items()}
        report[mode] = {
            "a_tokens_per_s": med["a"],
            "b_tokens_per_s": med["b"],
            "b_over_a": med["b"] / med["a"],
            "identical": same[mode],
            "runs": rates[mode],
        }
        print(
            f"{mode}: A {med['a']:.2f} tok/s, B {med['b']:.2f} tok/s, "
            f"B/A {med['b'] / med['a']:.3f}, identical {same[mode]}",
            flush=True,
        )
    base = modes[0]
    for mode in modes[1:]:  # each mode against the first, run by run (the same prompt, in turn)
        for side in ("a", "b"):
            pairs = zip(rates[mode][side], rates[base][side], strict=True)
            ratio = statistics.median(x / y for x, y in pairs)
            report[mode][f"{side}_over_{base}_paired"] = ratio
            print(f"{side.upper()}: {mode} / {base} {ratio:.3f} (median of paired runs)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ab.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
