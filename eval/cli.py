"""``d3d eval longbench``: run (or resume) the LongBench sweep, then write its report.

Also reachable as ``python -m eval.longbench``. The sweep appends to ``OUT/records.jsonl``
(resumable: rerun the same command); the report (summary.json, records.csv, results.md,
results.png) goes to ``--report-dir`` (default OUT). ``--report-only`` skips the models.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from compression.cli import add_compression_args, compression_config
from d3d.cli import add_model_args, model_config
from d3d.config import MODES
from eval.longbench.data import DEFAULT_LOCAL, load_longbench, take_per_dataset
from eval.longbench.report import write_report
from eval.longbench.runner import DEFAULT_MODE, RECORDS, Sweep, SweepConfig, read_records

log = logging.getLogger(__name__)
LONGBENCH_DEFAULT = ("qasper", "multifieldqa_en", "hotpotqa", "narrativeqa")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def load_items(args: argparse.Namespace, tokenizer) -> list:
    from eval.longbench.offline import offline_sets

    sets = _names(args.sets)
    unknown = set(sets) - {"offline", "longbench"}
    if unknown:
        raise ValueError(f"unknown set(s) {sorted(unknown)}: use offline and/or longbench")
    items = []
    if "offline" in sets:

        def count(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])

        sizes = tuple(int(x) for x in _names(args.sizes))
        items += offline_sets(count, sizes, args.per_size, args.data_seed)
    if "longbench" in sets:
        lb = load_longbench(_names(args.datasets), args.source, Path(args.local))
        items += take_per_dataset(lb, args.limit)
    return items


def argv_is_cli() -> bool:
    return len(sys.argv) > 3 and sys.argv[1:3] == ["eval", "longbench"]


def cmd_longbench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    report_dir = Path(args.report_dir or out)
    if not args.report_only:
        from tqdm import tqdm

        from d3d.engine import Engine

        mcfg = model_config(args)

        def sweep_config(drafter=None) -> SweepConfig:
            return SweepConfig(
                keep_ratios=_floats(args.keep),
                scorers=_names(args.scorers),
                modes=_names(args.modes),
                compression=compression_config(args, mcfg.target, False, drafter),
                max_length=args.max_length,
                max_new_tokens=args.max_new_tokens,
            )

        sweep_config()  # bad flags fail before the models load
        engine = Engine.from_config(mcfg, with_drafter=True)
        cfg = sweep_config(engine.drafter)
        items = load_items(args, engine.tokenizer)
        sweep = Sweep(engine, cfg, out, target_spec=mcfg.target)
        meta = {
            "command": "d3d eval longbench " + " ".join(sys.argv[3:] if argv_is_cli() else []),
            "sweep": asdict(cfg),
            "models": asdict(mcfg),
            "items": len(items),
        }
        (out / "config.json").write_text(json.dumps(meta, indent=2, default=str))
        n = sweep.run(
            items,
            progress=lambda total: tqdm(total=total, file=sys.stderr),
            budget_s=args.budget_s,
        )
        log.info("%d new records in %s", n, out / RECORDS)
    records = read_records(out / RECORDS)
    if not records:
        raise FileNotFoundError(f"no records in {out / RECORDS}: run the sweep first")
    write_report(records, report_dir)
    print((report_dir / "results.md").read_text())
    return 0


def add_longbench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sets", default="offline,longbench", help="offline and/or longbench")
    p.add_argument("--datasets", default=",".join(LONGBENCH_DEFAULT), help="LongBench tasks")
    p.add_argument("--source", default="auto", choices=["auto", "hub", "local"])
    p.add_argument("--local", default=str(DEFAULT_LOCAL), help="folder of LongBench jsonl files")
    p.add_argument("--limit", type=int, default=None, help="items per LongBench task")
    p.add_argument("--sizes", default="2,4,8", help="offline sizes in k tokens")
    p.add_argument("--per-size", type=int, default=4, help="offline items per set and size")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the offline sets")
    p.add_argument("--keep", default="1.0,0.5,0.2,0.1,0.05", help="keep ratios")
    p.add_argument("--scorers", default=",".join(SweepConfig().scorers), help="scorers")
    p.add_argument("--modes", default=DEFAULT_MODE, help=f"decode modes ({', '.join(MODES)})")
    p.add_argument("--max-length", type=int, default=None, help="prompt token limit (truncation)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on answer lengths")
    p.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--out", default="runs/longbench", help="records folder (resumable)")
    p.add_argument("--report-dir", default=None, help="where the report goes (default --out)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    add_model_args(p)
    add_compression_args(p, keep=False)
    p.set_defaults(func=cmd_longbench)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluation harnesses")
    inner = p.add_subparsers(dest="harness", required=True)
    lb = inner.add_parser("longbench", help="LongBench score vs latency over keep ratios")
    add_longbench_args(lb)
    from eval.speed.cli import register_speed
    from eval.speed.depths import register_depths

    register_speed(inner)
    register_depths(inner)
