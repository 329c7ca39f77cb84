"""The depth sweep's report: acceptance, forward costs and the modelled speed-up per depth.

Design: each depth L has a training run (``d3d train --drafter lora:L``, the same short budget
for all) and an offline held-out acceptance JSON (``d3d accept``). This module adds what the runs
do not measure — one target decode step, one 16-token target verify forward and one drafter
block forward at that depth, timed side by side in one process (:func:`d3d.tools.bench.run_micro`,
medians over interleaved repeats) — and writes a table, a JSON file and a plot.

The modelled speed-ups assume a greedy target and per-round costs that do not depend on the
context: ``sync`` = AL x t_step / (t_verify + t_block) (drafting in series), ``async`` = AL x
t_step / max(t_verify, t_block) (drafting fully hidden beside verification, on its own core, and
every branch guess a hit — an upper bound for the asynchronous pipeline).

Two steps: ``python -m d3d.training.sweep time --runs runs/sweep --depths 8 12 18 30`` (with
nothing else busy on the machine: it times forwards; an untrained drafter of a depth costs what a trained one
does) writes ``timings.json``; ``python -m d3d.training.sweep report --runs runs/sweep --depths
8 12 18 30 --out docs/depth_sweep`` joins it with the acceptance files.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DepthRow:
    """One depth: held-out acceptance, per-position acceptance and forward costs (ms)."""

    layers: int
    acceptance_length: float
    p_first: float  # share of rounds whose first draft (the anchor's prediction) is accepted
    p_second: float
    step_ms: float
    verify_ms: float
    block_ms: float

    @property
    def block_over_verify(self) -> float:
        return self.block_ms / self.verify_ms

    @property
    def sync_speedup(self) -> float:
        return self.acceptance_length * self.step_ms / (self.verify_ms + self.block_ms)

    @property
    def async_speedup(self) -> float:
        return self.acceptance_length * self.step_ms / max(self.verify_ms, self.block_ms)

    def to_dict(self) -> dict:
        out = asdict(self)
        for k in ("block_over_verify", "sync_speedup", "async_speedup"):
            out[k] = round(getattr(self, k), 3)
        return out


def markdown(rows: list[DepthRow]) -> str:
    """The sweep as a markdown table."""
    head = ("| layers L | held-out AL | P(d1 ok) | P(d1,d2 ok) | block ms | verify ms | step ms "
            "| block / verify | modelled sync | modelled async |")  # fmt: skip
    lines = [head, "|" + "---:|" * 10]
    for r in rows:
        lines.append(
            f"| {r.layers} | {r.acceptance_length:.3f} | {r.p_first:.3f} | {r.p_second:.3f} "
            f"| {r.block_ms:.1f} | {r.verify_ms:.1f} | {r.step_ms:.1f} | {r.block_over_verify:.2f} "
            f"| {r.sync_speedup:.2f}x | {r.async_speedup:.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[DepthRow], png: str | Path) -> Path:
    """Acceptance length and modelled speed-ups against depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.layers for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(xs, [r.acceptance_length for r in rows], "o-", color="tab:red", label="held-out AL")
    ax.set_xlabel("drafter layers L (of the target's 30; adapters at mask slots)")
    ax.set_ylabel("acceptance length")
    ax2 = ax.twinx()
    ax2.plot(xs, [r.async_speedup for r in rows], "s--", color="tab:blue", label="async (model)")
    ax2.plot(xs, [r.sync_speedup for r in rows], "^:", color="tab:gray", label="sync (model)")
    ax2.axhline(1.0, color="black", lw=0.5)
    ax2.set_ylabel("modelled speed-up vs ar")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88), fontsize=8)
    ax.set_title("Depth sweep: held-out acceptance and modelled speed-up")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)


def time_depths(depths: list[int], context: int, repeats: int) -> dict[int, dict]:
    """Step, verify and block medians (ms) per depth; an untrained adapter drafter costs what a
    trained one does, so this needs no training run."""
    from d3d.model.adapters import AdapterConfig
    from d3d.model.drafter import D3DDrafter
    from d3d.model.load import load_target
    from d3d.tools.bench import run_micro

    target = load_target("default")
    out = {}
    for n in depths:
        drafter = D3DDrafter.from_target(target.model, n, adapter=AdapterConfig())
        out[n] = run_micro(target.model, drafter, context, repeats).to_dict()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m d3d.training.sweep", description=__doc__)
    p.add_argument(
        "what", choices=["time", "report"], help="time the forwards, or write the report"
    )
    p.add_argument("--runs", required=True, help="folder with L{N}.accept.json and timings.json")
    p.add_argument("--depths", type=int, nargs="+", required=True)
    p.add_argument("--out", default=None, help="report folder (sweep.json, sweep.md, sweep.png)")
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    runs = Path(args.runs)
    if args.what == "time":
        torch.set_num_threads(args.threads)
        doc = {"command": "python -m d3d.training.sweep " + " ".join(argv or []),
               "timings": time_depths(args.depths, args.context, args.repeats)}  # fmt: skip
        (runs / "timings.json").write_text(json.dumps(doc, indent=2))
        print(json.dumps(doc))
        return 0
    timings = json.loads((runs / "timings.json").read_text())
    rows = []
    for n in args.depths:
        acc = json.loads((runs / f"L{n}.accept.json").read_text())
        t = timings["timings"][str(n)]
        per = acc["acceptance_per_position"]
        rows.append(DepthRow(n, acc["acceptance_length"], per[0], per[1], t["target_step_ms"],
                             t["target_verify_ms"], t["drafter_block_ms"]))  # fmt: skip
    out = Path(args.out or runs)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"timing_command": timings["command"], "rows": [r.to_dict() for r in rows]}
    (out / "sweep.json").write_text(json.dumps(doc, indent=2))
    (out / "sweep.md").write_text(markdown(rows) + "\n")
    plot(rows, out / "sweep.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
