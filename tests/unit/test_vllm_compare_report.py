"""The side-by-side report: its table, and the alternation's arms against vLLM."""

import json

from eval.vllm_compare import report


def level(tps: float, texts: dict) -> dict:
    return {"tokens_per_s": tps, "ttft_p50": 0.1, "texts": texts}


def test_the_report_shows_every_alternating_arm_against_vllm(tmp_path):
    texts = {"p1": "a", "p2": "b"}
    results = {
        "vllm": {"16": level(200.0, texts)},
        "d3d-auto": {"16": level(190.0, {"p1": "a", "p2": "c"})},
    }
    runs = {"vllm": [200.0, 210.0], "d3d-nodraft": [199.0, 205.0], "d3d-ar": [190.0, 196.0]}
    runs["d3d-auto"] = [188.0, 194.0]
    med = {n: sum(v) / 2 for n, v in runs.items()}
    ratios = {n: m / med["vllm"] for n, m in med.items() if n != "vllm"}
    alt = {"16": {"runs": runs, "median": med, "ratio": ratios["d3d-auto"], "ratios": ratios}}
    report(
        tmp_path, results, {"command": "python -m eval.vllm_compare --split", "alternating": alt}
    )
    md = (tmp_path / "compare.md").read_text()
    assert "| d3d-auto | 190.0 (0.95x) | 1/2 |" in md
    assert "| clients | vllm | d3d-nodraft | d3d-ar | d3d-auto |" in md
    assert "| 16 | 205.0 | 202.0 (0.985x) | 193.0 (0.941x) | 191.0 (0.932x) |" in md
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert "texts" not in saved["results"]["vllm"]["16"]
    assert (tmp_path / "compare.png").stat().st_size > 0
