"""``python -m eval.data_speed`` on the tiny Qwen3: both paths answer every prompt, the engine's
batched records equal its one-at-a-time records, and the JSON report is complete (no timing is
asserted: the script is a benchmark)."""

import json

from eval.data_speed import main


def test_the_comparison_runs_and_reports(tmp_path, qwen3_dir, qwen3_prompts):
    out = tmp_path / "speed.json"
    args = ["--target", str(qwen3_dir), "--source", f"jsonl:{qwen3_prompts}", "--n", "5",
            "--batch", "3", "--max-new-tokens", "6", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert [r["answers"] for r in report["rows"]] == [5, 5, 5, 5]
    assert report["batched_records_equal_one_at_a_time"] is True
    assert report["engine_vs_static_plain"] > 0 and report["n_prompts"] == 5
