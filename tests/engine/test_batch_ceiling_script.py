"""``python -m eval.batch_ceiling`` on the tiny Qwen3: it times the engine's forward at every
batch size, fits its cost and reports a ceiling per client count (no timing is asserted: the
script is a benchmark)."""

import json

from eval.batch_ceiling import main


def test_the_ceiling_is_reported_for_every_client_count(tmp_path, qwen3_dir):
    args = ["--target", str(qwen3_dir), "--clients", "3,5", "--max-tokens", "6",
            "--repeats", "2", "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "batch_ceiling.json").read_text())
    assert set(report["step_s"]) == {"1", "2", "3", "4", "5", "8"}
    assert all(s > 0 for s in report["step_s"].values())
    assert set(report["ceilings"]) == {"3", "5"}
    for c in report["ceilings"].values():
        assert c["prefill_together_s"] > 0 and c["decode_only"] > 0 and c["with_prompts"] > 0
