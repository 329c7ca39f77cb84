"""The GPU check runs end to end: the script itself in its CPU test mode (a tiny Qwen3-shaped
target, few tokens), every stage; the stages' arithmetic; on CUDA when there is one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from d3d.tools.gpu_check import main, projection
from d3d.tools.gpu_service import ServiceError, ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TINY_RUN = ["--tiny", "--context", "32", "--repeats", "1", "--drafter-layers", "2", "--no-vllm"]
SMALL_REPLAY = ["--prompt-tokens", "20", "--new-tokens", "24", "--replay-rows", "1,4"]


def test_script_tiny_runs_every_stage(tmp_path):
    """``scripts/gpu_check.sh --tiny``: the real script path (flags, stages, JSON) on CPU."""
    out = tmp_path / "gc.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--tiny", "gc.json", "--no-vllm"],  # relative to the caller's dir
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| decode step, 1 row(s) |" in proc.stdout  # the summary table
    res = json.loads(out.read_text())
    assert res["errors"] == [], res["errors"]
    assert set(res["stages"]) == {
        "bandwidth", "decode", "drafters", "exactness", "replay_1", "replay_16",
        "shaped_replay_1", "projection", "memory", "profile",
    }  # fmt: skip
    assert res["target_margins"]["residual_scale"] == 0.01
    assert res["target"] == "qwen3-8b-tiny" and res["elapsed_s"] < res["budget_s"]
    assert res["bandwidth"]["bytes_per_s"] > 0

    dec = res["decode"]
    assert dec["backend"] == "CudaTarget"  # the cuda backend's step code, eager on the CPU
    assert dec["rows"]["1"]["unfused_step_ms"] > 0  # the model's own forms, beside the fused
    assert dec["rows"]["1"]["torch_forms_step_ms"] > 0  # and the torch forms without Triton
    assert dec["kernels"] == {"module": False}  # no Triton kernel on a CPU (no interpreter)
    prof = res["profile"]["eager"]  # the 1-row step's operators (kernels on a GPU), by kind
    assert "graphs" not in res["profile"] and prof["launches"] > 0 and 0 < prof["busy"] <= 1.5
    assert prof["by_kind_us"]["matmul"] > 0 and prof["by_kind_us"]["attention"] > 0
    assert set(dec["rows"]) == {"1", "16", "64"} and dec["counts"]["eager"] == 0
    for r, row in dec["rows"].items():
        assert row["step_ms"] > 0 and row["verify16_ms"] > 0 and row["step_floor_ms"] > 0
        assert r == "1" or row["step_over_one_row"] > 0

    assert set(res["drafters"]) == {"d3d_1_7b", "self_2"}
    for row in res["drafters"].values():
        assert row["block_ms"] > 0 and row["packed_8_branches_ms"] > 0
        assert row["packed_8_over_verify16"] > 0
        assert row["packed_sample"]["agrees"], row["packed_sample"]  # the sample at load

    ex = res["exactness"]
    assert ex["rows_equal"] == ex["rows"] == 16 and not ex["captured"]
    assert ex["rehearsed"] and ex["graphs"] > 0  # the steps held to their graphs' first
    assert ex["two_threads_rows_equal"] == [16, 16]
    assert ex["torch_forms_rows_equal"] == 16

    shaped = res["shaped_replay_1"]
    assert "shape=" in shaped["settings"]["drafter"]  # the drafter's forwards, packed (eager)
    assert shaped["warmup"]["sync"]["drafter_new_shapes"] > 0  # the worker's packed steps
    assert shaped["modes"]["sync"]["drafter_new_shapes"] == 0  # all met in the warm-up
    assert "replay (instrument), the D3D-1.7B shape's forwards sync, 1 row(s)" in proc.stdout
    for key, rows in (("replay_1", 1), ("replay_16", 16), ("shaped_replay_1", 1)):
        svc = res[key]
        assert svc["settings"]["requests"] == rows and "replay" in svc["settings"]["drafter"]
        assert set(svc["modes"]) == {"ar", "sync", "async"}
        # each mode ran once unmeasured: the measured runs meet no new step shape (on a GPU a
        # graph captured in the measured time), while the unmeasured ones met the shapes
        assert all(r["new_shapes"] == 0 for r in svc["modes"].values()), key
        assert svc["warmup"]["ar"]["new_shapes"] > 0 and svc["warmup"]["sync"]["new_shapes"] > 0
        for mode in ("sync", "async"):
            r = svc["modes"][mode]
            assert r["matches_ar"] == rows, (key, mode)  # lossless, float32
            assert r["errors"] == [] and not r["timed_out"]
            assert r["syncs_per_decode_step"] is not None  # counted on CUDA only (0 here)
            assert 6.5 <= r["acceptance_length"] <= 9.0, (key, mode, r["acceptance_length"])
            assert r["decode_speedup_vs_ar"] > 0 and r["speedup_vs_ar"] > 0
        if not key.startswith("shaped"):  # a shape's branches only where they fit a verify
            assert svc["modes"]["async"]["branch_hits"] > 0
    for pr in res["projection"].values():
        assert pr["speedup_vs_ar"] > 0 and pr["paper_speedup"] == 5.0
    assert res["memory"]["plan_target_bytes"] > 0 and res["memory"]["measured_peak_bytes"] is None


def test_the_replay_keeps_to_its_recording_in_bf16(tmp_path):
    """In bf16 a verify rounds unlike a step, and a random target's near-ties flip: without
    :func:`d3d.tools.gpu_stages.wide_margins` the replayed requests leave their recording
    (here 1 of 16 within 64 tokens; all 16 of 16 of an 8B shape on an H200) and the instrument
    stops proposing for them; with it every request keeps to it."""
    out = tmp_path / "gc.json"
    flags = ["--dtype", "bfloat16", "--prompt-tokens", "24", "--new-tokens", "64"]
    assert main([*TINY_RUN, "--out", str(out), *flags, "--replay-rows", "16"]) == 0
    res = json.loads(out.read_text())
    assert res["dtype"] == "bfloat16" and res["target_margins"]["head"] == "embedding, permuted"
    for mode in ("sync", "async"):
        r = res["replay_16"]["modes"][mode]
        assert r["matches_ar"] == 16, mode
        assert 7.0 <= r["acceptance_length"] <= 8.8, (mode, r["acceptance_length"])


def test_projection_hides_a_round_that_fits_a_verify():
    hidden = projection(10.0, 12.0, 8.0, 4.0, acceptance=7.88, hit=0.78)
    assert hidden["hidden"] and hidden["round_ms"] == pytest.approx(12.0 + 0.22 * 4.0)
    assert hidden["speedup_vs_ar"] == pytest.approx(7.88 * 10.0 / 12.88, rel=1e-3)
    slow = projection(10.0, 12.0, 20.0, 4.0, acceptance=7.88, hit=1.0)
    assert not slow["hidden"] and slow["round_ms"] == 20.0


def test_out_of_time_skips_stages(tmp_path):
    out = tmp_path / "gc.json"
    assert main([*TINY_RUN, "--out", str(out), *SMALL_REPLAY, "--budget-s", "1"]) == 0
    res = json.loads(out.read_text())
    assert res["drafters"] == {"skipped": "out of time"}
    assert res["replay_4"] == {"skipped": "out of time"}


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
    assert main([*TINY_RUN, "--out", str(out), "--repeats", "3", *SMALL_REPLAY]) == 0
    res = json.loads(out.read_text())
    assert res["device"] != "cpu" and res["dtype"] == "bfloat16"
    assert res["exactness"]["captured"] and res["exactness"]["rows_equal"] == 16
    assert res["memory"]["measured_peak_bytes"] > 0


def test_the_profile_sorts_gpu_kernels_by_kind():
    from d3d.tools.step_profile import kind_of

    kinds = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1": "matmul",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16>": "matmul",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn>": "matmul",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "attention",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
        "_qk_in": "triton",
        "_add_norm": "triton",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "other",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>": "other",
        "Memcpy HtoD (Pinned -> Device)": "other",
    }  # fmt: skip
    for name, kind in kinds.items():
        assert kind_of(name) == kind, name


def test_a_drafter_worker_that_failed_is_an_error_of_the_check():
    """A failed draft leaves the request to the target alone (lossless, so `matches_ar` holds):
    the check names it instead of timing a `sync` that drafted nothing."""
    from d3d.tools.gpu_service import service_errors

    out = {"modes": {"ar": {"errors": []}, "sync": {"errors": ["x"], "worker_failures": 3}}}
    assert service_errors(out) == ["sync: x", "sync: the drafter worker failed 3 time(s)"]
    assert service_errors({"modes": {"sync": {"errors": [], "worker_failures": 0}}}) == []
