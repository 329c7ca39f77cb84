"""``python -m eval.engine_load`` on the tiny Qwen3: every setting runs every request to its
budget, alternately, and the medians are written (no speed is asserted: it is a benchmark)."""

import json

from eval.engine_load import main


def test_every_setting_serves_every_request_its_budget(tmp_path, qwen3_dir):
    out = tmp_path / "load.json"
    args = ["--target", str(qwen3_dir), "--clients", "3", "--requests", "5", "--input-len", "40",
            "--output-len", "6", "--settings", "2:4:16:0:0,2:4:16:64", "--repeats", "2",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert [r["setting"] for r in report["runs"]] == ["2:4:16:0:0", "2:4:16:64:0.5"] * 2
    assert all(r["tokens"] == 5 * 6 and r["tokens_per_s"] > 0 for r in report["runs"])
    # read whole (short 64) a 40-token prompt takes one step; in 16-token chunks three
    steps = {r["setting"]: r["steps"] for r in report["runs"]}
    assert steps["2:4:16:64:0.5"] < steps["2:4:16:0:0"]
    assert set(report["medians"]) == {"2:4:16:0:0", "2:4:16:64:0.5"}
