"""Evidence recall per scorer: does the kept prompt still hold the evidence? No target needed.

For every item of the chosen sets, each scorer scores the prompt once and selection runs at each
keep ratio; an item counts when its evidence survives whole in the kept context (the needle or
fact sentence, or a gold answer string for LongBench and NQ rows; LongBench rows whose full
context holds no answer string are left out, as in the sweep). Reported per set, scorer and keep
ratio: the recall, the paired difference against ``--baseline`` (BM25) with a 95 % bootstrap
interval over items, and the same on *low-overlap* items, whose question shares at most
``--overlap`` of its content words with the evidence (paraphrased questions, where word matching
is blind).

Sets: ``longbench`` (the local rows, truncated to the target's window as in the sweep),
``offline`` (needles and multi-document NQ at 4k and 8k, seed 0, as the sweep's offline set),
``nq30`` (a gold Wikipedia passage among ~30 others, 4k context), ``messy`` (twelve facts in
run-on sentences of one-line essay text, half the questions paraphrased).

    python -m eval.longbench.recall --sets messy,nq30,offline,longbench \\
        --scorers bm25,drafter,hybrid,attention-bm25 --keep 0.1,0.05 --out eval/results/recall

Resumable: each (item, scorer) result is one JSON line in ``records.jsonl`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from compression.compressor import CompressionConfig
from compression.scorers import words
from d3d.backends.sizes import UNSTATED_WINDOW
from d3d.backends.sizes import window as model_window
from eval.longbench.data import Item, load_longbench
from eval.longbench.messy import messy_items
from eval.longbench.offline import needle_items, nq_multidoc
from eval.longbench.prompts import item_parts, window_budget
from eval.longbench.report import bootstrap
from eval.longbench.runner import evidence_kept

SETS = ("messy", "nq30", "offline", "longbench")


def evidence_text(item: Item) -> str | None:
    """The text that holds the evidence (for the question's word overlap)."""
    if "needle" in item.meta:
        return item.meta["needle"]
    low = item.context.lower()
    for a in item.answers:
        if a.strip() and (at := low.find(a.lower())) >= 0:
            if "gold_passage" in item.meta:  # the whole gold passage
                head = item.context.rfind("Passage ", 0, at)
                tail = item.context.find("\nPassage ", at)
                return item.context[max(head, 0) : tail if tail > 0 else len(item.context)]
            return item.context[max(0, at - 300) : at + 300]
    return None


def overlap(item: Item) -> float | None:
    """Share of the question's content words found in the evidence text."""
    ev, q = evidence_text(item), set(words(item.input))
    if ev is None or not q:
        return None
    return len(q & set(words(ev))) / len(q)


def load_sets(names: list[str], tokenizer, per_set: int = 24) -> list[Item]:
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    items: list[Item] = []
    for name in names:
        if name == "messy":
            items += messy_items(4000, 0)
        elif name == "nq30":
            items += [replace(i, dataset="nq30") for i in nq_multidoc(count, 4, per_set, seed=3)]
        elif name == "offline":
            for size in (4, 8)[: 1 if per_set <= 8 else 2]:
                items += needle_items(count, size, 4, 0) + nq_multidoc(count, size, 4, 0)
        elif name == "longbench":
            items += load_longbench(None, "local")
        else:
            raise ValueError(f"unknown set {name!r}: choose from {', '.join(SETS)}")
    return items


def set_of(item: Item) -> str:
    if item.dataset in ("messy_needles", "nq30"):
        return item.dataset
    return "offline" if item.dataset.startswith(("needle_", "nq_multidoc")) else "longbench"


def summarise(records: list[dict], baseline: str, low: float, n_boot: int = 2000) -> list[dict]:
    """Recall and paired differences against ``baseline`` per set, scorer and keep ratio."""
    by = defaultdict(dict)  # (set, keep) -> item -> scorer -> kept
    for r in records:
        for k, kept in r["kept"].items():
            if kept is not None:
                by[(r["set"], k)].setdefault(r["item"], {})[r["scorer"]] = (kept, r["overlap"])
    out = []
    for (name, keep), items in sorted(by.items()):
        scorers = sorted({s for v in items.values() for s in v})
        for s in scorers:
            pairs = [
                (float(v[s][0]), float(v[baseline][0]), v[s][1])
                for v in items.values()
                if s in v and baseline in v
            ]
            if not pairs:
                continue
            row = {"set": name, "keep": keep, "scorer": s, "n": len(pairs)}
            row["recall"] = round(sum(p[0] for p in pairs) / len(pairs), 3)
            diff = bootstrap(pairs, lambda ps: sum(a - b for a, b, _ in ps) / len(ps), n_boot)
            row["vs_baseline"] = [round(diff.value, 3), round(diff.low, 3), round(diff.high, 3)]
            lo = [p for p in pairs if p[2] is not None and p[2] <= low]
            row["low_overlap_n"] = len(lo)
            if lo:
                row["low_overlap_recall"] = round(sum(p[0] for p in lo) / len(lo), 3)
                row["low_overlap_baseline"] = round(sum(p[1] for p in lo) / len(lo), 3)
            out.append(row)
    return out


def markdown(rows: list[dict], baseline: str) -> str:
    lines = [
        f"| set | keep | scorer | n | recall | − {baseline} [95 %] | low-overlap n | "
        f"low-overlap recall | {baseline} there |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["vs_baseline"]
        lines.append(
            f"| {r['set']} | {r['keep']} | {r['scorer']} | {r['n']} | {r['recall']:.2f} | "
            f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}] | {r['low_overlap_n']} | "
            f"{r.get('low_overlap_recall', float('nan')):.2f} | "
            f"{r.get('low_overlap_baseline', float('nan')):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.longbench.recall", description=__doc__)
    p.add_argument("--sets", default="messy,nq30,offline,longbench")
    p.add_argument("--scorers", default="bm25,drafter,hybrid,attention-bm25")
    p.add_argument("--keep", default="0.1,0.05")
    p.add_argument("--per-set", type=int, default=24, help="nq30 items; offline: 4k only if <= 8")
    p.add_argument("--baseline", default="bm25")
    p.add_argument("--overlap", type=float, default=0.5, help="low overlap: at most this share")
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gap", default=None, help="gap separator (default: the config's)")
    p.add_argument("--out", default="runs/recall")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--from-sweep", default=None, help="a sweep's folder: its evidence, as records")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    if args.from_sweep:
        records = from_sweep(Path(args.from_sweep))
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif not args.report_only:
        records += run(args, {(r["item"], r["scorer"]) for r in records}, path)
    rows = summarise(records, args.baseline, args.overlap)
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "recall.md").write_text(markdown(rows, args.baseline))
    print(markdown(rows, args.baseline))
    return 0


def from_sweep(folder: Path) -> list[dict]:
    """A LongBench sweep's ``evidence_kept`` per item, scorer and keep ratio, as recall records
    (the questions' word overlap from the local rows)."""
    rows = [json.loads(x) for x in (folder / "records.jsonl").read_text().splitlines() if x]
    by_id = {i.id: i for i in load_longbench(None, "local")}
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r["scorer"] == "full" or r["item"] not in by_id:
            continue
        item = by_id[r["item"]]
        rec = out.setdefault(
            (r["item"], r["scorer"]),
            {"item": r["item"], "set": set_of(item), "scorer": r["scorer"], "kept": {},
             "overlap": overlap(item), "score_s": r.get("compress_s")},
        )  # fmt: skip
        rec["kept"][f"{r['keep_ratio']:g}"] = r.get("evidence_kept")
    return list(out.values())


def compressor(qa, name: str):
    """The DocumentQA's compressor for ``name``; ``hybrid@sum``: the hybrid with that fusion."""
    if "@" not in name:
        return qa.compressor(name)
    from compression.compressor import Compressor

    base, fusion = name.split("@")
    cfg = replace(qa.cfg, scorer=base, hybrid_fusion=fusion)
    engine = qa.engine
    return Compressor.build(
        cfg, qa.tokenizer, engine.drafter, engine.target.model, question=qa.question()
    )


def run(args: argparse.Namespace, done: set, path: Path) -> list[dict]:
    from compression.doc_cache import DocumentCache
    from compression.qa import DocumentQA
    from d3d.config import ModelConfig
    from d3d.engine import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_config(ModelConfig(args.target, args.drafter), with_drafter=True)
    tok = engine.tokenizer
    cfg = CompressionConfig()
    if args.gap is not None:
        cfg = replace(cfg, gap=args.gap)
    qa = DocumentQA(engine, cfg, cache=DocumentCache(max_entries=4))
    window = model_window(engine.target.model.config) or UNSTATED_WINDOW
    items = load_sets(args.sets.split(","), tok, args.per_set)
    keeps = [float(k) for k in args.keep.split(",")]
    new = []
    with path.open("a") as f:
        for item in items:
            if evidence_text(item) is None:
                continue  # no evidence to keep (a LongBench row with no answer string in it)
            parts = item_parts(item, tok, window_budget(window, item))
            full = tok.decode(parts.context)
            for scorer in args.scorers.split(","):
                if (item.id, scorer) in done:
                    continue
                comp = compressor(qa, scorer)
                t0 = time.perf_counter()
                scored = comp.score(parts)
                secs = time.perf_counter() - t0
                kept = {}
                for k in keeps:
                    text = tok.decode(comp.select(parts, scored, k).parts.context)
                    kept[f"{k:g}"] = evidence_kept(item, text, full)
                rec = {"item": item.id, "set": set_of(item), "scorer": scorer, "kept": kept,
                       "overlap": overlap(item), "score_s": round(secs, 3),
                       "context_tokens": len(parts.context)}  # fmt: skip
                f.write(json.dumps(rec) + "\n")
                f.flush()
                new.append(rec)
                print(json.dumps(rec), flush=True)
    return new


if __name__ == "__main__":
    sys.exit(main())
