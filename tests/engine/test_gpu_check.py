"""The GPU check runs end to end: the script itself in its CPU test mode (a tiny Qwen3-shaped
target, few tokens), every stage including the engine's service run; on CUDA when there is one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from d3d.tools.gpu_check import main
from d3d.tools.gpu_service import ServiceError, ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# In process: the vLLM stage is the script test's (it starts two vLLM engines)
TINY_RUN = ["--tiny", "--context", "32", "--repeats", "1", "--drafter-layers", "2", "--no-vllm"]
SMALL_SERVICE = ["--requests", "4", "--prompt-tokens", "20", "--new-tokens", "6"]


def test_script_tiny_runs_every_stage(tmp_path):
    """``scripts/gpu_check.sh --tiny``: the real script path (flags, stages, JSON) on CPU."""
    out = tmp_path / "gc.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--tiny", "gc.json"],  # relative to the caller's directory
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| async |" in proc.stdout  # the summary table
    res = json.loads(out.read_text())
    assert res["errors"] == [] and set(res["stages"]) == {"build", "check", "service", "vllm"}
    assert res["target"] == "qwen3-8b-tiny" and res["elapsed_s"] < res["budget_s"]
    assert res["target_step_ms"] > 0 and res["drafters"]["2"]["overlap"]["overlap_factor"] > 0

    svc = res["service"]
    assert svc["settings"]["requests"] == 16 and svc["devices"] == {
        "target": "cpu",
        "drafter": "cpu",
    }
    assert set(svc["modes"]) == {"ar", "sync", "async"}
    vl = res["vllm"]
    if "skipped" not in vl:  # vLLM installed: D3D inside it answers as vLLM alone
        for mode in ("sync", "async", "auto"):
            assert vl[mode]["identical"] == vl[mode]["requests"] == 16, (mode, vl[mode])
    new = svc["settings"]["new_tokens"]
    for mode, r in svc["modes"].items():
        assert not r["timed_out"] and r["errors"] == [], mode
        assert r["finished"] == 16 and r["tokens"] == 16 * new  # EOS off: every request to length
        assert r["tok_s"] > 0 and r["decode_tok_s"] > 0 and r["speedup_vs_ar"] > 0
        assert r["steps"] == r["decode_steps"] + r["prefill_steps"] and r["decode_steps"] > 0
        assert r["verify_ms"]["median"] > 0 and r["rows_per_decode_step"]["max"] == 16
        assert r["peak_memory_bytes"] is None  # CUDA's allocator only
    for mode in ("sync", "async"):
        r = svc["modes"][mode]
        assert r["matches_ar"] == 16  # lossless: float32 greedy equals ar, token for token
        assert r["num_drafts"] > 0 and r["acceptance_length"] >= 1.0
        assert r["worker_failures"] == 0
    assert svc["modes"]["async"]["branch_hits"] + svc["modes"]["async"]["branch_misses"] > 0
    mem = svc["memory"]
    assert mem["measured_peak_bytes"] is None and mem["predicted_peak_bytes"]["cpu"] > 0
    plan = svc["memory_plan"]["settings"]
    assert plan["batch"] == 16 and plan["max_kv_tokens"] == 24 + new + 16


def test_check_figures_in_process(tmp_path):
    out = tmp_path / "gc.json"
    assert main([*TINY_RUN, "--out", str(out), "--no-service"]) == 0
    res = json.loads(out.read_text())
    assert res["target_step_ms"] > 0 and res["target_verify16_ms"] > 0
    assert "service" not in res and set(res["stages"]) == {"build", "check"}
    row = res["drafters"]["2"]
    assert set(row["branches_ms"]) == {str(n) for n in range(1, 9)}
    assert row["overlap"]["overlap_factor"] > 0
    mem = res["memory"]  # counted everywhere, allocated where CUDA counts
    assert (
        mem["target_weight_bytes"]["counted"] > 0
        and mem["kv_bytes"]["counted"] == 2 * 6 * 2 * 32 * 4 * 32
    )
    assert set(row["memory"]) == {"drafter_bytes", "build_peak_extra_bytes"}


def test_stage_time_limit_cancels_and_still_reports(tmp_path):
    """A mode past its limit cancels its requests; the JSON says so, and the run goes on."""
    out = tmp_path / "gc.json"
    argv = [*TINY_RUN, "--drafter-layers", "", "--out", str(out), *SMALL_SERVICE]
    assert (
        main([*argv, "--modes", "ar,async", "--drafter", "self:1", "--stage-seconds", "1e-9"]) == 0
    )
    modes = json.loads(out.read_text())["service"]["modes"]
    for r in modes.values():
        assert r["timed_out"] and r["stop_reasons"] == {"cancelled": 4} and r["tokens"] == 0
    assert "matches_ar" not in modes["async"]


def test_out_of_time_skips_stages(tmp_path):
    out = tmp_path / "gc.json"
    assert main([*TINY_RUN, "--out", str(out), *SMALL_SERVICE, "--budget-s", "1"]) == 0
    res = json.loads(out.read_text())
    assert res["drafters"]["2"] == {"skipped": "out of time"}
    assert {r.get("skipped") for r in res["service"]["modes"].values()} == {"out of time"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_full_shape_without_cuda_fails_clearly(tmp_path, capsys):
    out = tmp_path / "gc.json"
    assert main(["--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not out.exists()


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([*TINY_RUN, "--out", str(tmp_path / "gc.json"), "--modes", "ar,fast"])
    assert exc.value.code == 2
    with pytest.raises(ServiceError, match="requests"):
        ServiceSettings(requests=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_on_cuda(tmp_path):
    out = tmp_path / "gc.json"
    assert main([*TINY_RUN, "--out", str(out), "--repeats", "3", *SMALL_SERVICE]) == 0
    res = json.loads(out.read_text())
    assert res["device"] != "cpu" and res["dtype"] == "torch.bfloat16"
    mem = res["service"]["memory"]
    (dev,) = mem["measured_peak_bytes"]
    assert mem["measured_peak_bytes"][dev] > 0 and mem["predicted_peak_bytes"][dev] > 0
