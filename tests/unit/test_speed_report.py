"""``d3d eval speed``'s report: rates from sums, the best ar as baseline, the pipeline's figures."""

import json

import pytest

from eval.speed.report import summarize, write_report


def rec(method, request, tokens, decode_s, identical=True, bench="gsm8k", **kw):
    return {
        "method": method,
        "request": request,
        "benchmark": bench,
        "num_tokens": tokens + 1,
        "decode_s": decode_s,
        "identical": identical,
        **kw,
    }


RECORDS = [
    rec("ar-1t", "a#0", 100, 4.0),
    rec("ar-all", "a#0", 100, 5.0),
    rec("sync", "a#0", 100, 6.0, num_drafts=50, num_accepted_tokens=50, draft_s=2.0),
    rec(
        "async",
        "a#0",
        100,
        4.5,
        num_drafts=50,
        num_accepted_tokens=50,
        draft_s=0.5,
        branch_hits=30,
        branch_misses=20,
        branches_prepared=150,
        branch_rounds=50,
        hit_round_s=3.3,
        hit_verify_s=3.0,
    ),
    rec("auto", "a#0", 100, 3.9, identical=False, spec_tokens=60, ar_tokens=40),
]


def test_rates_speedups_and_lossless():
    s = summarize(RECORDS)["gsm8k"]
    rows = s["rows"]
    assert rows["ar-1t"]["tokens_per_s"] == 25.0 and rows["ar-1t"]["speedup_vs_best_ar"] == 1.0
    assert rows["ar-all"]["speedup_vs_best_ar"] == pytest.approx(0.8)
    assert rows["sync"]["acceptance_length"] == 2.0 and rows["sync"]["hit_rate"] is None
    assert rows["async"]["hit_rate"] == 0.6 and rows["async"]["branches_per_round"] == 3.0
    assert rows["auto"]["lossless"] is False, "a differing output is reported, never hidden"
    p = s["pipeline"]
    assert p["hidden_share_of_sync_drafting"] == pytest.approx(0.75)  # (6 - 4.5) / 2
    assert p["hit_round_over_verify"] == pytest.approx(1.1)
    assert p["async_over_sync"] == pytest.approx(6.0 / 4.5, abs=1e-3)
    assert p["auto_over_best_ar"] == pytest.approx(4.0 / 3.9, abs=1e-3)


def test_write_report(tmp_path):
    write_report(RECORDS, tmp_path, {"command": "d3d eval speed"})
    assert json.loads((tmp_path / "summary.json").read_text())["summary"]["all"]["rows"]
    md = (tmp_path / "results.md").read_text()
    assert "| async |" in md and "**no**" in md
    assert (tmp_path / "results.png").stat().st_size > 1000
