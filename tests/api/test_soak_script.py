"""``python -m eval.soak`` for a few seconds against ``d3d serve`` of a tiny random model
(started by the script itself): the report, its samples, the criteria and the plot are written
(no timing is asserted: the script is a benchmark)."""

import json

from eval.soak import main
from tests.api.conftest import free_port
from tests.conftest import tiny_model, tiny_tokenizer


def test_a_short_soak_writes_its_report_and_plot(tmp_path, capsys):
    target = tmp_path / "tiny"
    tiny_model("llama", seed=1, window=512).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    args = ["--clients", "2", "--minutes", "0.05", "--sample-every", "1", "--max-tokens", "8",
            "--out", str(tmp_path / "soak"), "--plot", str(tmp_path / "soak.png"),
            "--port", str(free_port()), "--server-args", f"--target {target} --threads 1"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "/0.05 min]" in printed  # the progress lines
    assert "scaled by minutes/30" in printed and "errors: 0 -> PASS" in printed
    report = json.loads((tmp_path / "soak" / "soak.json").read_text())
    assert report["meta"]["server_args"][-4:] == ["--target", str(target), "--threads", "1"]
    assert report["criteria"]["errors"] == 0 and report["criteria"]["windows"]["scaled"]
    assert len(report["requests"]) > 0 and all(r[1] == 200 and r[4] > 0 for r in report["requests"])
    assert len(report["samples"]) >= 2
    first = report["samples"][0]
    assert first["rss"] > 0 and first["rss"] == sum(first["processes"].values())
    assert any("d3d serve" in name for name in first["processes"])
    assert all(s["kv"] is not None for s in report["samples"])
    assert [m["minute"] for m in report["minutes"]] == [1]
    assert (tmp_path / "soak.png").stat().st_size > 0
