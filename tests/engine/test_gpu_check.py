"""The GPU readiness script runs end to end (on a tiny model; on CUDA when there is one)."""

import json

import pytest
import torch

from d3d.tools.gpu_check import main


def test_gpu_check_tiny_writes_every_figure(tmp_path):
    out = tmp_path / "gc.json"
    assert (
        main(
            [
                "--tiny",
                "--out",
                str(out),
                "--context",
                "32",
                "--repeats",
                "1",
                "--drafter-layers",
                "2",
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["target_step_ms"] > 0 and res["target_verify16_ms"] > 0
    row = res["drafters"]["2"]
    assert set(row["branches_ms"]) == {str(n) for n in range(1, 9)}
    assert row["overlap"]["overlap_factor"] > 0
    mem = res["memory"]  # counted everywhere, allocated where CUDA counts
    assert (
        mem["target_weight_bytes"]["counted"] > 0
        and mem["kv_bytes"]["counted"] == 2 * 6 * 2 * 16 * 4 * 32
    )
    assert set(row["memory"]) == {"drafter_bytes", "build_peak_extra_bytes"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_on_cuda(tmp_path):
    out = tmp_path / "gc.json"
    assert main(["--tiny", "--out", str(out), "--repeats", "3"]) == 0
    assert json.loads(out.read_text())["device"] != "cpu"
