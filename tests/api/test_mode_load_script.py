"""``eval.mode_load`` against a live tiny server: every mode's runs alternate, the summary gives
medians and ratios against the base mode, and greedy answers agree across modes. No timing is
asserted: the script is a benchmark."""

from __future__ import annotations

import json

from eval.mode_load import main, summary, table
from tests.api.conftest import tiny_server


def test_modes_alternate_and_answers_agree(tmp_path):
    srv = tiny_server(max_queue=64)
    try:
        argv = ["--url", srv.url, "--levels", "1,3", "--repeats", "2", "--max-tokens", "6"]
        assert main([*argv, "--out", str(tmp_path)]) == 0
    finally:
        srv.stop()
    summ = json.loads((tmp_path / "mode_load.json").read_text())["summary"]
    assert set(summ) == {"1", "3"}
    for s in summ.values():
        assert s["ratio"]["ar"] == 1.0 and s["ratio"]["auto"] > 0
        assert len(s["rounds"]["auto"]) == len(s["rounds"]["ar"]) == 2
        same, total = s["identical"]["auto"]
        assert total > 0 and same == total and sum(s["failed"].values()) == 0
    assert "| 3 |" in (tmp_path / "mode_load.md").read_text()


def test_a_differing_answer_is_counted():
    def run(tps: float, text: str) -> dict:
        return {"tokens_per_s": tps, "texts": {"p": text, "q": "same"}, "requests": 2, "ok": 2}

    runs = {8: {"auto": [run(10.0, "x"), run(12.0, "y")], "ar": [run(10.0, "x"), run(8.0, "x")]}}
    s = summary(runs, "ar")["8"]
    assert s["median"] == {"auto": 11.0, "ar": 9.0} and s["identical"]["auto"] == (3, 4)
    assert "11.0 (1.222x)" in table({"8": s}, "ar")
