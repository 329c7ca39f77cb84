"""Training curves: the loss and validation acceptance a run logged, as a plot.

``OUT/log.jsonl`` gets one line per optimizer step (``loss``, ``block``, ``ntp``, ``lr``,
``seconds``) and one per validation (``val_acceptance_length``); a resumed run repeats the steps
since its last checkpoint, and the last line for a step wins. ``OUT/curve.png`` plots the raw
loss, its moving average and the validation acceptance against the step.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_log(path: str | Path) -> tuple[dict[int, dict], dict[int, float]]:
    """Training rows and validation acceptance by step from ``log.jsonl``; when a resumed run
    repeats steps, the last line for a step wins."""
    rows: dict[int, dict] = {}
    val: dict[int, float] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "val_acceptance_length" in row:
            val[int(row["step"])] = float(row["val_acceptance_length"])
        elif "loss" in row:
            rows[int(row["step"])] = row
    return dict(sorted(rows.items())), dict(sorted(val.items()))


def plot_log(log_path: str | Path, png: str | Path, window: int = 50) -> Path | None:
    """Loss (raw and a ``window``-step moving average) and validation acceptance vs step."""
    rows, val = read_log(log_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(rows)
    loss = [rows[s]["loss"] for s in steps]
    avg = [sum(loss[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1)
           for i in range(len(loss))]  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.6, label="training loss")
    ax.plot(steps, avg, color="tab:blue", lw=1.4, label=f"loss, {window}-step mean")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if val:
        ax2 = ax.twinx()
        ax2.plot(list(val), list(val.values()), "o-", color="tab:red", label="val acceptance")
        ax2.set_ylabel("validation acceptance length")
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88), fontsize=8)
    ax.set_title("Drafter training")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)
