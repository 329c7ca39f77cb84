"""Sweep records -> summary JSON, CSV, Markdown table with paired bootstrap intervals, PNG plot.

Every compressed setting is compared with the full prompt *on the same items* (paired): the score
difference and the end-to-end speed-up (mean full-prompt seconds / mean setting seconds) get 95 %
percentile intervals from a bootstrap over items (2,000 resamples, seeded). The head-to-head
table compares scorers at the same keep ratio the same way (score difference, paired by item).

Scores are 100 x the mean item score over all items of a setting (the sets mix LongBench tasks
and offline sets; per-dataset scores are in the JSON).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from compression.compressor import DEFAULT_SCORER

FULL = "full"
LEADS = (
    DEFAULT_SCORER,
    "drafter-match",
    "drafter",
    "hybrid",
    "drafter-attention",
)  # head-to-head: the first run
REFERENCE = (
    "Published reference (D3D paper, Qwen3-8B target on GPUs, LongBench single-document QA): "
    "keep 0.1 scored 47.05 against 47.91 for the full prompt, 3.32x faster end to end "
    "(the full prompt with speculative decoding: 1.40x)."
)
OFFLINE_PREFIXES = ("needle_", "nq_multidoc_")
CSV_FIELDS = (
    "item", "dataset", "scorer", "keep_ratio", "mode", "score", "total_tokens", "kept_tokens",
    "new_tokens", "compress_s", "prefill_s", "decode_s", "total_s", "evidence_kept", "prediction",
)  # fmt: skip


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def fmt(self, digits: int = 1, suffix: str = "") -> str:
        d = digits
        return f"{self.value:.{d}f}{suffix} [{self.low:.{d}f}, {self.high:.{d}f}]"


@dataclass(frozen=True)
class Row:
    """One setting (scorer, keep ratio, mode) against the full prompt on its items."""

    scorer: str
    keep_ratio: float
    mode: str
    n: int
    score: Interval
    delta: Interval
    seconds: float
    speedup: Interval
    compress_s: float
    prefill_s: float
    decode_s: float
    kept_tokens: float
    evidence_kept: float | None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def bootstrap(pairs: Sequence[tuple], stat, n: int = 2000, seed: int = 0) -> Interval:
    """Percentile 95 % interval of ``stat(sample)`` over item resamples."""
    value = stat(pairs)
    rng = random.Random(seed)
    draws = sorted(stat([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(n))
    return Interval(value, draws[int(0.025 * n)], draws[min(n - 1, int(0.975 * n))])


def _index(records: Sequence[dict]) -> dict:
    by = defaultdict(dict)
    for r in records:
        by[(r["scorer"], float(r["keep_ratio"]), r["mode"])][r["item"]] = r
    return by


def rows(records: Sequence[dict], n_boot: int = 2000) -> list[Row]:
    by = _index(records)
    out = []
    for (scorer, keep, mode), recs in sorted(
        by.items(), key=lambda kv: (kv[0][2], -kv[0][1], kv[0][0])
    ):
        full = by.get((FULL, 1.0, mode), {})
        items = [i for i in recs if i in full]
        if not items:
            continue
        pairs = [
            (recs[i]["score"], full[i]["score"], recs[i]["total_s"], full[i]["total_s"])
            for i in items
        ]
        ev = [recs[i]["evidence_kept"] for i in items if recs[i].get("evidence_kept") is not None]
        out.append(
            Row(
                scorer=scorer,
                keep_ratio=keep,
                mode=mode,
                n=len(items),
                score=bootstrap(pairs, lambda p: 100 * _mean([x[0] for x in p]), n_boot),
                delta=bootstrap(pairs, lambda p: 100 * _mean([x[0] - x[1] for x in p]), n_boot),
                seconds=_mean([p[2] for p in pairs]),
                speedup=bootstrap(
                    pairs, lambda p: _mean([x[3] for x in p]) / _mean([x[2] for x in p]), n_boot
                ),
                compress_s=_mean([recs[i]["compress_s"] for i in items]),
                prefill_s=_mean([recs[i]["prefill_s"] for i in items]),
                decode_s=_mean([recs[i]["decode_s"] for i in items]),
                kept_tokens=_mean([recs[i]["kept_tokens"] for i in items]),
                evidence_kept=100 * _mean(ev) if ev else None,
            )
        )
    return out


def head_to_head(
    records: Sequence[dict], scorer: str, others: Sequence[str], n_boot: int = 2000
) -> list[dict]:
    """Paired score difference ``scorer - other`` at every shared keep ratio and mode."""
    by = _index(records)
    out = []
    for (name, keep, mode), recs in sorted(by.items()):
        if name != scorer:
            continue
        for other in others:
            theirs = by.get((other, keep, mode), {})
            items = [i for i in recs if i in theirs]
            if not items:
                continue
            pairs = [(recs[i]["score"], theirs[i]["score"]) for i in items]
            iv = bootstrap(pairs, lambda p: 100 * _mean([a - b for a, b in p]), n_boot)
            out.append({"scorer": scorer, "other": other, "keep_ratio": keep, "mode": mode, "n": len(items), "delta": asdict(iv)})  # fmt: skip
    return out


def per_dataset(records: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Score per dataset for every setting: {"scorer@keep/mode": {dataset: 100 x mean}}."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        acc[f"{r['scorer']}@{r['keep_ratio']:g}/{r['mode']}"][r["dataset"]].append(r["score"])
    return {k: {d: round(100 * _mean(v), 2) for d, v in ds.items()} for k, ds in acc.items()}


def per_dataset_speedup(records: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Speed-up per dataset for every setting: mean full-prompt seconds / mean setting seconds,
    over the items both ran."""
    by = _index(records)
    out: dict[str, dict[str, float]] = {}
    for (scorer, keep, mode), recs in by.items():
        full = by.get((FULL, 1.0, mode), {})
        acc: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for i, r in recs.items():
            if i in full:
                acc[r["dataset"]].append((full[i]["total_s"], r["total_s"]))
        out[f"{scorer}@{keep:g}/{mode}"] = {
            d: round(sum(a for a, _ in v) / sum(b for _, b in v), 2) for d, v in acc.items()
        }
    return out


def _dataset_table(title: str, values: dict[str, dict[str, float]], fmt: str) -> list[str]:
    names = sorted({d for v in values.values() for d in v})
    keys = sorted(values, key=lambda k: (k.split("@")[0] != FULL, k))
    lines = ["", title, "", "| setting | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]  # fmt: skip
    for k in keys:
        cells = [format(values[k][d], fmt) if d in values[k] else "" for d in names]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _rows_table(table: Sequence[Row]) -> list[str]:
    lines = [
        "| scorer | keep | mode | n | score | Δ vs full | e2e s | speed-up | compress s | prefill s | decode s | kept tok | evidence kept % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        ev = "" if r.evidence_kept is None else f"{r.evidence_kept:.0f}"
        lines.append(
            f"| {r.scorer} | {r.keep_ratio:g} | {r.mode} | {r.n} | {r.score.fmt()} | {r.delta.fmt()} "
            f"| {r.seconds:.2f} | {r.speedup.fmt(2, 'x')} | {r.compress_s:.2f} | {r.prefill_s:.2f} "
            f"| {r.decode_s:.2f} | {r.kept_tokens:.0f} | {ev} |"
        )
    return lines


def _h2h_table(h2h: Sequence[dict]) -> list[str]:
    lines = ["| scorer | vs | keep | mode | n | Δ score |", "|---|---|---|---|---|---|"]
    for h in h2h:
        iv = Interval(**h["delta"])
        lines.append(f"| {h['scorer']} | {h['other']} | {h['keep_ratio']:g} | {h['mode']} | {h['n']} | {iv.fmt()} |")  # fmt: skip
    return lines


def source_of(dataset: str) -> str:
    """``offline`` for the sets built here, ``longbench`` for LongBench tasks."""
    return "offline" if dataset.startswith(OFFLINE_PREFIXES) else "longbench"


def markdown(
    table: Sequence[Row],
    h2h: Sequence[dict],
    datasets: dict,
    n_items: int,
    speed: dict | None = None,
    by_source: dict | None = None,
) -> str:
    lines = [
        f"Items: {n_items}. Score = 100 x mean item score; Δ and speed-up are paired with the full "
        "prompt on the same items; [95 % bootstrap interval].",
        "",
        *_rows_table(table),
        "",
        REFERENCE,
    ]
    if h2h:
        lines += ["", "Head to head at the same budget (paired by item):", "", *_h2h_table(h2h)]
    for source, (sub_table, sub_h2h, n) in (by_source or {}).items():
        lines += ["", f"Only the {source} items ({n}):", "", *_rows_table(sub_table)]
        if sub_h2h:
            lines += ["", *_h2h_table(sub_h2h)]
    lines += _dataset_table("Score per dataset:", datasets, ".1f")
    if speed:
        lines += _dataset_table("End-to-end speed-up per dataset (vs full prompt):", speed, ".2f")
    return "\n".join(lines) + "\n"


def _complete(table: Sequence[Row]) -> list[Row]:
    """The settings run on every item (so all points average the same items)."""
    n_all = max((r.n for r in table), default=0)
    return [r for r in table if r.n == n_all]


def plot(table: Sequence[Row], path: Path, panels: dict[str, Sequence[Row]] | None = None) -> None:
    """Score against mean end-to-end seconds, one line per scorer and mode (full prompt as a
    star), one panel per item source (``panels``: title -> its rows; else all items), and the
    share of items whose evidence was kept against the keep ratio.

    Only settings run on every item of a panel are drawn (a partial run's other settings stay
    in the table with their n).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dict(panels or {"all items": table})
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(6.2 * (len(panels) + 1), 4.6))
    colours: dict[str, str] = {}
    for ax, (title, sub) in zip(axes, panels.items(), strict=False):
        sub = _complete(sub)
        n = max((r.n for r in sub), default=0)
        for mode in sorted({r.mode for r in sub}):
            for scorer in sorted({r.scorer for r in sub} - {FULL}):
                pts = sorted((r.seconds, r.score.value, r.keep_ratio) for r in sub if r.scorer == scorer and r.mode == mode)  # fmt: skip
                if not pts:
                    continue
                (line,) = ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=f"{scorer} ({mode})",
                    color=colours.get(f"{scorer} ({mode})"),
                )
                colours[f"{scorer} ({mode})"] = line.get_color()
                for x, y, k in pts:
                    ax.annotate(f"{k:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")  # fmt: skip
            for r in (r for r in sub if r.scorer == FULL and r.mode == mode):
                ax.plot([r.seconds], [r.score.value], marker="*", markersize=14, color="black", linestyle="", label=f"full prompt ({mode})")  # fmt: skip
        ax.set_xlabel("mean end-to-end seconds per item")
        ax.set_ylabel("score (100 x mean item score)")
        ax.set_title(f"{title} ({n} items): score vs latency, labels = keep ratio", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    rows_all = _complete(table)
    for scorer in sorted({r.scorer for r in rows_all} - {FULL}):
        pts = sorted((r.keep_ratio, r.evidence_kept) for r in rows_all if r.scorer == scorer and r.evidence_kept is not None)  # fmt: skip
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=scorer)
    ax.set_xscale("log")
    ax.set_xlabel("keep ratio")
    ax.set_ylabel("items whose evidence was kept whole (%)")
    ax.set_title("Evidence recall (items whose context holds the evidence)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(records: Sequence[dict], out: Path, n_boot: int = 2000, png: bool = True) -> dict:
    """Write summary.json, records.csv, results.md (and results.png); returns the summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = rows(records, n_boot)
    scorers = sorted({r["scorer"] for r in records} - {FULL})
    lead = next((s for s in LEADS if s in scorers), scorers[0] if scorers else "")
    h2h = head_to_head(records, lead, [s for s in scorers if s != lead], n_boot) if lead else []
    datasets = per_dataset(records)
    speed = per_dataset_speedup(records)
    by_source = {}
    sources = sorted({source_of(r["dataset"]) for r in records})
    for source in sources if len(sources) > 1 else []:
        sub = [r for r in records if source_of(r["dataset"]) == source]
        others = [s for s in scorers if s != lead]
        sub_h2h = head_to_head(sub, lead, others, n_boot) if lead else []
        by_source[source] = (rows(sub, n_boot), sub_h2h, len({r["item"] for r in sub}))
    n_items = len({r["item"] for r in records})
    summary = {
        "n_items": n_items,
        "rows": [asdict(r) for r in table],
        "head_to_head": h2h,
        "per_dataset": datasets,
        "per_dataset_speedup": speed,
        "by_source": {
            k: {"n_items": n, "rows": [asdict(r) for r in t], "head_to_head": h}
            for k, (t, h, n) in by_source.items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    with (out / "records.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    (out / "results.md").write_text(markdown(table, h2h, datasets, n_items, speed, by_source))
    if png and table:
        panels = {f"{k}": v[0] for k, v in by_source.items()} or {"all items": table}
        plot(table, out / "results.png", panels)
    return summary
