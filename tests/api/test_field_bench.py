"""``eval.field_bench`` drives vLLM's own benchmark client (``vllm bench serve``) against a live
tiny server: no request fails and, with ``ignore_eos`` (the client's default on its random
dataset), every answer has exactly the asked length; the report's table names both servers'
figures. No timing is asserted: the script is a benchmark."""

from __future__ import annotations

import argparse

import pytest

from eval.field_bench import Config, bench_argv, configs, run_bench
from eval.field_report import lengths_ok, medians, table
from tests.api.conftest import tiny_server
from tests.conftest import tiny_tokenizer

pytest.importorskip("vllm.benchmarks.serve")


@pytest.fixture(scope="module")
def server():
    srv = tiny_server(max_queue=64)
    yield srv
    srv.stop()


def test_vllm_bench_serve_against_the_service(server, tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    custom = tmp_path / "prompts.jsonl"
    custom.write_text('{"prompt": "w5 w6 w7"}\n{"prompt": "w9 w1"}\n')
    runs = []
    for cfg in (
        Config("random c4", "random", 4, 8, 24, 12),
        Config("project c2", "custom", 2, 2, 1, 6),
    ):
        res = run_bench(bench_argv(cfg, server.url, str(tmp_path / "tok"), custom))
        assert "error" not in res, res
        assert res["completed"] == cfg.prompts and res["failed"] == 0, res["errors"]
        assert res["median_ttft_ms"] > 0 and len(res["ttfts_s"]) == cfg.prompts
        if cfg.dataset == "random":
            assert res["output_lens"] == [12] * 8 and lengths_ok(res, vars(cfg))
        runs.append({**res, "server": "d3d", "config": vars(cfg)})
    runs.append(
        {**runs[0], "server": "vllm", "output_throughput": 2 * runs[0]["output_throughput"]}
    )
    report = table(runs)
    assert "| random c4 |" in report and "| 0.50 |" in report and "| project c2 |" in report


def test_configs_follow_the_flags():
    args = argparse.Namespace(levels="1,16", num_prompts=8, datasets="random,project",
                              input_len=256, output_len=64, long_prompts=16, long_input_len=2048,
                              long_concurrency=4, only="")  # fmt: skip
    names = [c.name for c in configs(args)]
    assert names == ["random c1", "project c1", "random c16", "project c16", "long c4"]
    assert [c.prompts for c in configs(args)][:3] == [8, 8, 16]
    args.only = "long,c1"
    assert [c.name for c in configs(args)] == ["random c1", "project c1", "long c4"]
    with pytest.raises(ValueError, match="dataset"):
        Config("x", "sharegpt", 1, 1, 1, 1)


def test_rounds_report_medians_and_every_round():
    cfg = vars(Config("random c4", "random", 4, 2, 24, 12))

    def run(server: str, r: int, tps: float, lens=(12, 12)) -> dict:
        return {"server": server, "config": cfg, "round": r, "output_throughput": tps,
                "median_ttft_ms": 10.0 * r, "median_tpot_ms": 5.0, "failed": r == 3,
                "output_lens": list(lens)}  # fmt: skip

    runs = [run("d3d", 1, 100.0), run("vllm", 1, 110.0), run("vllm", 2, 90.0),
            run("d3d", 2, 120.0), run("d3d", 3, 80.0, (12, 11)), run("vllm", 3, 100.0)]  # fmt: skip
    m = medians(runs)
    d3d, vllm = m[("d3d", "random c4")], m[("vllm", "random c4")]
    assert d3d["output_throughput"] == vllm["output_throughput"] == 100.0
    assert d3d["median_ttft_ms"] == 20.0 and d3d["rounds"] == [100.0, 120.0, 80.0]
    assert d3d["failed"] == 1 and not d3d["lengths_ok"] and vllm["lengths_ok"]
    report = table(runs)
    assert "| random c4 | 100.0 | 100.0 | 1.00 | 20.0 | 20.0 | 1.00 |" in report
    assert "| 1 | no |" in report
    assert (
        "| random c4 | 100.0 / 110.0 (0.91) | 120.0 / 90.0 (1.33) | 80.0 / 100.0 (0.80) |" in report
    )
