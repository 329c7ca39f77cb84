"""``d3d eval speed``'s report: a table per benchmark, the pipeline's own figures, a plot.

Per benchmark and method, from the records of one run: acceptance length (1 + accepted /
drafts), branch hit rate and branches per round, tokens/s and time per output token after the
prefill (sums over requests, so long answers weigh more), the speed-up against the faster of the
two ``ar`` rows, and whether every output equals ``ar``'s. Beside them, the asynchronous
pipeline's figures: the share of ``sync``'s drafting time that ``async`` takes off the critical
path, hit-round time over verify time, and ``auto`` against the best ``ar``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from eval.speed.methods import AR_KEYS, METHODS


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def summarize(records: list[dict]) -> dict:
    by: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by[(r["benchmark"], r["method"])].append(r)
        by[("all", r["method"])].append(r)
    benchmarks = [*sorted({b for b, _ in by if b != "all"}), "all"]
    out: dict = {}
    for b in benchmarks:
        rows = {}
        for key in METHODS:
            rs = by.get((b, key))
            if not rs:
                continue
            toks = sum(max(r["num_tokens"] - 1, 0) for r in rs)
            secs = sum(r["decode_s"] for r in rs)
            drafts = sum(r.get("num_drafts", 0) for r in rs)
            hits = sum(r.get("branch_hits", 0) for r in rs)
            misses = sum(r.get("branch_misses", 0) for r in rs)
            brounds = sum(r.get("branch_rounds", 0) for r in rs)
            rows[key] = {
                "requests": len(rs),
                "tokens": toks,
                "decode_s": round(secs, 3),
                "tokens_per_s": round(toks / secs, 3) if secs else 0.0,
                "tpot_ms": round(1e3 * secs / toks, 2) if toks else None,
                "acceptance_length": round(
                    1 + sum(r.get("num_accepted_tokens", 0) for r in rs) / drafts, 3
                )
                if drafts
                else None,
                "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                "branches_per_round": round(
                    sum(r.get("branches_prepared", 0) for r in rs) / brounds, 2
                )
                if brounds
                else None,
                "spec_tokens": sum(r.get("spec_tokens", 0) for r in rs),
                "ar_tokens": sum(r.get("ar_tokens", 0) for r in rs),
                "worker_failures": sum(r.get("worker_failures", 0) for r in rs),
                "lossless": all(r["identical"] is not False for r in rs),
            }
        best_ar = max((rows[k]["tokens_per_s"] for k in AR_KEYS if k in rows), default=0.0)
        for row in rows.values():
            row["speedup_vs_best_ar"] = _ratio(row["tokens_per_s"], best_ar)
        out[b] = {"rows": rows, "pipeline": _pipeline(by, b, rows)}
    return out


def _pipeline(by: dict, b: str, rows: dict) -> dict:
    """The asynchronous pipeline's figures, on the requests both sides ran."""
    fig: dict = {}
    sync = {r["request"]: r for r in by.get((b, "sync"), [])}
    asyn = {r["request"]: r for r in by.get((b, "async"), [])}
    both = sorted(set(sync) & set(asyn))
    if both:
        saved = sum(sync[q]["decode_s"] - asyn[q]["decode_s"] for q in both)
        fig["hidden_share_of_sync_drafting"] = _ratio(saved, sum(sync[q]["draft_s"] for q in both))
    if asyn:
        hr = sum(r["hit_round_s"] for r in asyn.values())
        fig["hit_round_over_verify"] = _ratio(hr, sum(r["hit_verify_s"] for r in asyn.values()))
    for key, name in (("async", "async_over_sync"), ("auto", "auto_over_best_ar")):
        if key in rows:
            base = rows["sync"]["tokens_per_s"] if key == "async" and "sync" in rows else None
            if key == "auto":
                base = max((rows[k]["tokens_per_s"] for k in AR_KEYS if k in rows), default=None)
            if base:
                fig[name] = _ratio(rows[key]["tokens_per_s"], base)
    return fig


def _fmt(x, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# Decoding speed on {meta.get('host', 'this host')}", ""]
    lines.append(f"Command: `{meta.get('command', '')}`")
    lines.append("")
    for b, block in summary.items():
        lines += [
            f"## {b}",
            "",
            "| method | requests | acceptance length | hit rate | branches | tokens/s | ms / token | speed-up vs best ar | lossless |",
            "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for key, r in block["rows"].items():
            lines.append(
                f"| {METHODS[key].label} | {r['requests']} | {_fmt(r['acceptance_length'])} | "
                f"{_fmt(r['hit_rate'], '.0%')} | {_fmt(r['branches_per_round'], '.1f')} | "
                f"{r['tokens_per_s']:.2f} | {_fmt(r['tpot_ms'], '.1f')} | "
                f"{_fmt(r['speedup_vs_best_ar'])}x | {'yes' if r['lossless'] else '**no**'} |"
            )
        p = block["pipeline"]
        if p:
            lines.append("")
            lines.append(
                "async pipeline: "
                + "; ".join(f"{k.replace('_', ' ')} {_fmt(v, '.3f')}" for k, v in p.items())
            )
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = [b for b in summary if b != "all"] + ["all"]
    keys = [k for k in METHODS if any(k in summary[b]["rows"] for b in benches)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(benches) * len(keys) / 4), 4.5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ys = [summary[b]["rows"].get(key, {}).get("speedup_vs_best_ar") or 0 for b in benches]
        xs = [j + i * width for j in range(len(benches))]
        ax.bar(xs, ys, width, label=METHODS[key].label)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(benches))], benches)
    ax.set_ylabel("tokens/s vs the best ar row")
    ax.set_title("Decoding speed-up, same prompts, one run")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records: list[dict], out: Path, meta: dict) -> dict:
    summary = summarize(records)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))
    (out / "results.md").write_text(markdown(summary, meta))
    plot(summary, out / "results.png")
    return summary
