"""The Qwen3 recipe (:mod:`d3d.training.recipe`): its commands parse for Qwen3-8B and Qwen3-32B,
its compute follows from the published shapes, and the same commands — data, train from
another model, prune, evaluate — run end to end on tiny random Qwen3 models with the real
Qwen3 tokenizer."""

from __future__ import annotations

import dataclasses
import json

import pytest

from d3d.cli import build_parser, main
from d3d.training.data import read_many
from d3d.training.data_cli import shard_commands
from d3d.training.recipe import QWEN3_8B, QWEN3_32B, SHAPES, compute, launcher, stage_commands
from tests.conftest import QWEN3_INIT_HIDDEN


@pytest.mark.parametrize("recipe", [QWEN3_8B, QWEN3_32B], ids=lambda r: r.name)
def test_the_documented_commands_parse(recipe):
    parser = build_parser()
    for stage, args in stage_commands(recipe).items():
        ns = parser.parse_args(args)
        assert ns.func.__name__ == {"evaluate": "cmd_drafter_eval"}.get(stage, f"cmd_{stage}")
    assert launcher(recipe, "train")[:3] == ["torchrun", "--nproc_per_node", "8"]
    assert launcher(recipe, "prune") == ["d3d"]
    # The data is vLLM's on GPUs: one process per GPU, started by `d3d data --gpus 8` itself.
    assert launcher(recipe, "data") == ["d3d"]
    data = stage_commands(recipe)["data"]
    assert data[data.index("--engine") + 1] == "vllm" and data[data.index("--gpus") + 1] == "8"


def test_compute_follows_from_the_shapes():
    billions = {k: round(s.params / 1e9, 2) for k, s in SHAPES.items()}
    assert billions == {"Qwen/Qwen3-0.6B": 0.6, "Qwen/Qwen3-1.7B": 1.72, "Qwen/Qwen3-4B": 4.02,
                        "Qwen/Qwen3-8B": 8.19, "Qwen/Qwen3-32B": 32.76}  # fmt: skip
    small, big = compute(QWEN3_8B), compute(QWEN3_32B)
    assert [s.stage for s in small] == ["data", "train", "prune", "evaluate"]
    assert all(s.flops > 0 and s.gpu_hours > 0 for s in small + big)
    # Training a 4B drafter costs about 4B/1.7B of training a 1.7B one on the same tokens.
    ratio = big[1].flops / small[1].flops
    assert 2.0 < ratio < 3.0


def test_the_recipe_runs_end_to_end_on_tiny_qwen3_models(
    capsys, tmp_path, qwen3_dir, qwen3_init_dir
):
    prompts = tmp_path / "prompts.jsonl"
    topics = ["rivers", "bread", "stars", "trains", "music", "snow", "maps", "bees"]
    rows = [{"prompt": f"Tell me about {t}."} for t in topics]
    rows += [{"messages": [{"role": "user", "content": f"Why do {t} matter?"}]} for t in topics]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = dataclasses.replace(
        QWEN3_8B, name="tiny", target=str(qwen3_dir), init=str(qwen3_init_dir),
        root=str(tmp_path / "run"), prompts_file=str(prompts), device="cpu", dtype="float32",
        gpus=1, threads=1, prompts=len(rows), max_new_tokens=10, max_prompt_tokens=256,
        data_batch=4, heldout_fraction=0.25, epochs=1.0, global_batch=4, max_len=48, anchors=3,
        lr=1e-3, warmup=1, val_seqs=1, val_every=2, save_every=2, min_layers=2, max_stages=1,
        recovery_steps=1, recovery_batch=2, val_stride=4, eval_prompts=2, eval_tokens=8,
    )  # fmt: skip
    commands = stage_commands(r)
    for stage in ("data", "train", "prune", "evaluate"):
        assert launcher(r, stage) == ["d3d"]
        assert main(commands[stage]) == 0, stage
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # drafter-eval's
    assert report["lossless"] is True and report["n_prompts"] == 2 and report["num_drafts"] > 0
    records = read_many(r.data_path)
    heldout = [x for x in records if x["split"] == "heldout"]
    assert len(records) == len(rows) and heldout
    final = json.loads((tmp_path / "run" / "train" / "final" / "drafter.json").read_text())
    assert final["meta"]["init"] == str(qwen3_init_dir.resolve())
    assert final["lm_config"]["hidden_size"] == QWEN3_INIT_HIDDEN
    stages = json.loads((tmp_path / "run" / "prune" / "stages.json").read_text())["stages"]
    assert [s["layers_kept"] for s in stages] == [3, 2]
    assert (tmp_path / "run" / "prune" / "chosen" / "drafter.json").is_file()


def test_vllm_data_on_several_gpus_starts_one_shard_per_gpu(capsys):
    argv = ["data", "--engine", "vllm", "--gpus", "2", "--out", "o.jsonl", "--device", "cuda:0"]
    cmds = shard_commands(argv, 2)
    assert [env for env, _ in cmds] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    for i, (_, cmd) in enumerate(cmds):
        assert cmd[1:3] == ["-m", "d3d"] and "--gpus" not in cmd and "2" not in cmd[3:7]
        assert cmd[-4:] == ["--shard", f"{i}/2", "--device", "cuda"]  # the last --device wins
    assert shard_commands(["data", "--gpus=4"], 4)[3][1][3:] == [
        "data",
        "--shard",
        "3/4",
        "--device",
        "cuda",
    ]
    # Several GPUs are vLLM's processes, or torchrun's for the own engine.
    assert main(["data", "--gpus", "2", "--out", "x.jsonl"]) == 2
    assert "--gpus" in capsys.readouterr().err
