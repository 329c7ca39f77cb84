"""``d3d eval speed``: decoding speed of every mode on the standard benchmarks, and its report.

Thin: parses flags into a :class:`~eval.speed.run.SpeedConfig`, loads the engine (its drafter
worker started at load), runs or resumes the sweep, writes ``summary.json``, ``results.md`` and
``results.png`` next to ``records.jsonl``. ``--report-only`` rewrites the report from the records.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from d3d.cli import add_model_args, model_config
from eval.speed.methods import METHODS
from eval.speed.prompts import BENCHMARKS
from eval.speed.report import markdown, write_report
from eval.speed.run import RECORDS, SpeedConfig, read_records, run_speed


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def cmd_speed(args: argparse.Namespace) -> int:
    cfg = SpeedConfig(
        benchmarks=_names(args.benchmarks),
        n=args.n,
        methods=_names(args.methods),
        max_new_tokens=args.max_new_tokens,
    )
    bad = [b for b in cfg.benchmarks if b not in BENCHMARKS]
    if bad:
        raise ValueError(f"unknown benchmark(s) {bad}: use {', '.join(BENCHMARKS)}")
    out = Path(args.out)
    if not args.report_only:
        from d3d.engine import Engine

        engine = Engine.from_config(model_config(args), start_worker=True)
        try:
            if engine.worker() is None:
                raise ValueError("the drafter worker did not start")
            run_speed(engine, cfg, out, progress=not args.no_progress)
        finally:
            engine.close()
    records = read_records(out / RECORDS)
    if not records:
        raise ValueError(f"no records in {out / RECORDS}")
    meta = {
        "command": "d3d " + " ".join(sys.argv[1:]),
        "host": f"{platform.machine()} CPU, {len(__import__('os').sched_getaffinity(0))} cores",
        "config": vars(cfg) | {"benchmarks": list(cfg.benchmarks), "methods": list(cfg.methods)},
    }
    summary = write_report(records, out, meta)
    print(markdown(summary, meta))
    return 0


def register_speed(inner: argparse._SubParsersAction) -> None:
    """Adds ``speed`` under ``d3d eval``."""
    p = inner.add_parser("speed", help="decoding speed of every mode on standard benchmarks")
    p.add_argument("--out", default="runs/speed", help="records and report go here")
    p.add_argument("--benchmarks", default=",".join(BENCHMARKS), help="comma-separated")
    p.add_argument("--n", type=int, default=16, help="prompts per benchmark")
    p.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--report-only", action="store_true", help="rewrite the report, run nothing")
    p.add_argument("--no-progress", action="store_true")
    add_model_args(p)
    p.set_defaults(func=cmd_speed)
