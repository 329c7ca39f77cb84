"""Training at scale, on the CPU: ``torchrun --nproc_per_node 2 -m d3d train`` (gloo) trains the
same drafter as one process with the same global batch — DDP and FSDP alike, losses and weights
within float tolerance — and a run resumes from a checkpoint written at another world size.
Gradient checkpointing changes no loss and no gradient."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from d3d.cli import main
from tests.engine.test_drafters_any_target import train_args

ROOT = Path(__file__).resolve().parents[2]


def torchrun(n: int, args: list) -> None:
    """``torchrun --standalone --nproc_per_node n -m d3d ARGS`` (a free port) with this checkout
    on the path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(n), "-m", "d3d", *map(str, args)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        # SIGTERM: torchrun stops its workers (each in a process group of its own) first.
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        pytest.fail(f"torchrun timed out:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "drafter.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=2e-6, rtol=1e-5, msg=k)


FLAGS = ("--steps", "4", "--save-every", "2", "--keep-every", "2", "--val-every", "2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, qwen3_dir, qwen3_init_dir, qwen3_data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    out = {k: root / k for k in ("single", "ddp", "fsdp")}
    assert (
        main(
            [
                str(a)
                for a in train_args(qwen3_dir, qwen3_init_dir, qwen3_data, out["single"], *FLAGS)
            ]
        )
        == 0
    )
    torchrun(2, train_args(qwen3_dir, qwen3_init_dir, qwen3_data, out["ddp"], *FLAGS))
    torchrun(
        2,
        train_args(
            qwen3_dir, qwen3_init_dir, qwen3_data, out["fsdp"], *FLAGS, "--parallel", "fsdp"
        ),
    )
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_train_what_one_does(runs, kind):
    one, two = losses(runs["single"]), losses(runs[kind])
    assert sorted(two) == [1, 2, 3, 4]
    assert two == pytest.approx(one, rel=1e-5)
    assert json.loads((runs[kind] / "config.json").read_text())["world"] == 2
    assert_same_weights(runs["single"] / "final", runs[kind] / "final")
    assert weights(runs[kind] / "final")["mask_embedding"].shape == (96,)  # the --init width


def test_a_run_resumes_at_another_world_size(runs, tmp_path, qwen3_dir, qwen3_init_dir, qwen3_data):
    # Steps 1-2 ran in two processes (DDP); one process takes over from their checkpoint.
    shutil.copytree(runs["ddp"] / "step_2", tmp_path / "one" / "last")
    args = train_args(qwen3_dir, qwen3_init_dir, qwen3_data, tmp_path / "one", *FLAGS)
    assert main([str(a) for a in args]) == 0
    assert sorted(losses(tmp_path / "one")) == [3, 4]
    assert_same_weights(runs["single"] / "final", tmp_path / "one" / "final")
    assert torch.load(tmp_path / "one" / "last" / "trainer.pt")["step"] == 4
    # Steps 1-2 ran in one process; two FSDP processes shard its state and take over.
    shutil.copytree(runs["single"] / "step_2", tmp_path / "two" / "last")
    torchrun(2, train_args(qwen3_dir, qwen3_init_dir, qwen3_data, tmp_path / "two", *FLAGS,
                           "--parallel", "fsdp"))  # fmt: skip
    assert sorted(losses(tmp_path / "two")) == [3, 4]
    assert_same_weights(runs["single"] / "final", tmp_path / "two" / "final")


def test_gradient_checkpointing_changes_nothing(qwen3_dir, qwen3_init_dir, qwen3_data):
    from d3d.model.load import load_target
    from d3d.training.data import read_many
    from d3d.training.init import init_drafter
    from d3d.training.objectives import LossConfig, drafter_loss
    from d3d.training.train import TrainConfig, packed_sequence, prepare

    target = load_target(str(qwen3_dir))
    rec = read_many(qwen3_data)[1]
    out = []
    for ckpt in (False, True):
        d = init_drafter(f"init:{qwen3_init_dir}", target)
        cfg = TrainConfig(max_len=48, grad_checkpointing=ckpt, loss=LossConfig(anchors_per_seq=3))
        params = prepare(d, cfg)
        assert d.lm.model.layers[0].gradient_checkpointing == ckpt
        d.train()
        loss = drafter_loss(d, packed_sequence(rec, 0, d.block_size, cfg), cfg.loss).total
        loss.backward()
        out.append((float(loss.detach()), [p.grad.clone() for p in params]))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    for a, b in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_keeps_fp32_master_weights_under_bf16_autocast(
    capsys, tmp_path, qwen3_dir, qwen3_init_dir, qwen3_data
):
    args = train_args(qwen3_dir, qwen3_init_dir, qwen3_data, tmp_path / "run", "--device", "cuda",
                      "--dtype", "bfloat16")  # fmt: skip
    assert main([str(a) for a in args]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 3 and report["loss"] == report["loss"]  # finite, not NaN
    stored = weights(tmp_path / "run" / "final")
    assert stored["lm.model.layers.0.mlp.up_proj.weight"].dtype == torch.float32  # trained
    assert stored["lm.model.embed_tokens.weight"].dtype == torch.bfloat16  # frozen
