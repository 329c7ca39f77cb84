"""Drafters for any target, on a tiny Qwen3 made like Qwen3-8B (real tokenizer, untied head,
151,936 rows): ``d3d data --prompts`` writes the target's greedy answers through the engine,
``d3d train --init OTHER`` trains a drafter of another width and depth (a second tiny Qwen3,
tied head, as the small Qwen3 models have) that then works everywhere a drafter works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from d3d.cli import main
from d3d.config import DecodeConfig, ModelConfig
from d3d.engine import DrafterFactory, Engine, build_drafter
from d3d.model.drafter import D3DDrafter, DraftSession
from d3d.model.load import load_target
from d3d.model.specs import borrowed_layers
from d3d.training.data import read_many
from tests.conftest import (
    QWEN3_INIT_HIDDEN,
    QWEN3_INIT_LAYERS,
    QWEN3_PROMPTS,
    QWEN3_VOCAB,
    greedy_continuation,
    qwen3_like,
)

EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
INIT_HIDDEN, INIT_LAYERS = QWEN3_INIT_HIDDEN, QWEN3_INIT_LAYERS


def run(capsys, *args: str) -> dict:
    assert main([str(a) for a in args]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def data_args(target: Path, prompts: Path, out: Path, *flags: str) -> list[str]:
    return ["data", "--prompts", prompts, "--out", out, "--target", target, "--max-new-tokens",
            "12", "--heldout-fraction", "0", "--threads", "1", "--quiet", *flags]  # fmt: skip


def train_args(target: Path, init: Path, data: Path, out: Path, *flags: str) -> list[str]:
    return ["train", "--target", target, "--init", init, "--data", data, "--out", out,
            "--steps", "3", "--grad-accum", "4", "--lr", "1e-3", "--warmup", "1", "--max-len",
            "48", "--anchors", "3", "--val-seqs", "1", "--val-every", "100", "--save-every",
            "100", "--threads", "1", "--quiet", *flags]  # fmt: skip


@pytest.fixture(scope="session")
def trained(tmp_path_factory, qwen3_dir, qwen3_init_dir, qwen3_data) -> Path:
    out = tmp_path_factory.mktemp("train") / "run"
    assert main([str(a) for a in train_args(qwen3_dir, qwen3_init_dir, qwen3_data, out)]) == 0
    return out / "final"


# ----- d3d data -----------------------------------------------------------------------------
def test_data_writes_the_targets_greedy_responses(qwen3_data, qwen3_dir):
    loaded = load_target(str(qwen3_dir))
    records = {r["id"]: r for r in read_many(qwen3_data)}
    assert len(records) == len(QWEN3_PROMPTS)
    for rec in records.values():
        text = loaded.tokenizer.decode(rec["prompt_ids"])
        assert text.endswith(f"{rec['prompt']}<|im_end|>\n{EMPTY_THINK}")  # non-thinking
        want = greedy_continuation(loaded.model, rec["prompt_ids"], 12)
        assert rec["response_ids"] == want[: len(rec["response_ids"])]
        assert len(rec["response_ids"]) == 12 or rec["response_ids"][-1] in loaded.eos_token_ids
    chat = records["chat/1"]
    assert chat["prompt"] == "Another one?" and len(chat["messages"]) == 3
    assert "Blue." in loaded.tokenizer.decode(chat["prompt_ids"])  # earlier turns are context


# ----- d3d train --init ---------------------------------------------------------------------
def test_train_init_saves_a_drafter_of_the_other_width(trained, qwen3_init_dir):
    meta = json.loads((trained / "drafter.json").read_text())["meta"]
    assert meta["init"] == str(qwen3_init_dir.resolve()) and not meta["shared_embeddings"]
    assert meta["layers"] == list(range(INIT_LAYERS)) and meta["vocab_size"] == QWEN3_VOCAB
    stored = load_file(str(trained / "drafter.safetensors"))
    assert stored["lm.model.embed_tokens.weight"].shape == (QWEN3_VOCAB, INIT_HIDDEN)
    assert stored["mask_embedding"].shape == (INIT_HIDDEN,)
    assert (
        stored["lm.model.layers.2.mlp.down_proj.weight"].shape
        == (3 * INIT_HIDDEN, INIT_HIDDEN)[::-1]
    )
    assert "lm.lm_head.weight" not in stored  # tied: stored once, tied again on load
    init = load_file(str(qwen3_init_dir / "model.safetensors"))
    assert torch.equal(stored["lm.model.embed_tokens.weight"], init["model.embed_tokens.weight"])
    changed = stored["lm.model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(changed, init["model.layers.0.self_attn.q_proj.weight"])  # trained


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_generate_with_the_init_drafter_equals_ar(capsys, qwen3_dir, trained, mode):
    def generate(*flags: str) -> dict:
        return run(capsys, "generate", "Name a prime number.", "--target", qwen3_dir, "--json",
                   "--fresh-costs", "--threads", "1", "--max-new-tokens", "24", *flags)  # fmt: skip

    ar = generate("--mode", "ar")
    spec = generate("--mode", mode, "--drafter", trained, "--drafter-device", "cpu")
    assert spec["token_ids"] == ar["token_ids"] and spec["num_drafts"] > 0


def test_the_init_drafter_loads_everywhere_a_drafter_does(qwen3_dir, trained):
    target = load_target(str(qwen3_dir))
    built = build_drafter(str(trained), target, share_layers=True)
    assert built.lm.config.hidden_size == INIT_HIDDEN
    assert built.lm.get_input_embeddings() is not target.model.get_input_embeddings()
    assert built.lm.get_output_embeddings().weight is built.lm.get_input_embeddings().weight
    # The drafter process reads none of the target's layers for it, and builds the same drafter.
    assert borrowed_layers(str(trained), str(qwen3_dir)) == ()
    cfg = ModelConfig(target=str(qwen3_dir), drafter=str(trained), pack=False)
    other = DrafterFactory(cfg)()
    ids = target.tokenizer("The sea is", add_special_tokens=False)["input_ids"]
    assert (
        DraftSession(other).draft(ids).tokens.tolist()
        == DraftSession(built).draft(ids).tokens.tolist()
    )
    # Batched with other rows in the engine: every row's sync output is its ar output.
    engine = Engine(target, built)
    prompts = [engine.encode(p) for p in ("Say hi.", "Count to three.", "List fruits.")]
    for p in prompts:
        ar = engine.generate_ids(p, DecodeConfig(mode="ar", max_new_tokens=16)).token_ids
        sy = engine.generate_ids(p, DecodeConfig(mode="sync", max_new_tokens=16)).token_ids
        assert sy == ar


def test_the_init_drafter_drafts_in_its_own_process(qwen3_dir, trained):
    from d3d.worker.workers import available_cores

    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs two cores")
    cfg = ModelConfig(target=str(qwen3_dir), drafter=str(trained),
                      drafter_device=f"cpu:{cores[-1]}", threads=1)  # fmt: skip
    engine = Engine.from_config(cfg, start_worker=True)
    try:
        worker = engine.worker()
        assert worker is not None and worker.info["kind"] == "process"
        prompt = engine.encode("Name a prime number.")
        ar = engine.generate_ids(prompt, DecodeConfig(mode="ar", max_new_tokens=24))
        got = engine.generate_ids(prompt, DecodeConfig(mode="async", max_new_tokens=24))
        assert got.token_ids == ar.token_ids and got.stats.num_drafts > 0
    finally:
        engine.close()


def test_train_init_with_adapters_stores_only_what_trained(capsys, tmp_path, qwen3_dir, qwen3_init_dir,
                                                         qwen3_data):  # fmt: skip
    out = tmp_path / "run"
    report = run(
        capsys, *train_args(qwen3_dir, qwen3_init_dir, qwen3_data, out, "--adapter-rank", "4")
    )
    assert report["steps"] == 3
    stored = load_file(str(out / "final" / "drafter.safetensors"))
    assert stored and not [k for k in stored if k.startswith("lm.")]  # the init model's: re-read
    target = load_target(str(qwen3_dir))
    back = D3DDrafter.load(out / "final", target.model)
    assert back.meta.init == str(qwen3_init_dir.resolve()) and back.adapters is not None
    assert not back.exact_prefix  # its frozen layers are another model's, not the target's
    lora = back.adapters.lora["0__self_attn__q_proj"]
    assert lora.A.shape == (4, INIT_HIDDEN) and float(lora.B.abs().sum()) > 0


def test_init_refuses_another_tokenizer(tmp_path, qwen3_dir, qwen3_data, capsys):
    from tests.conftest import tiny_tokenizer

    other = qwen3_like(seed=2, layers=1, hidden=32)
    other.save_pretrained(tmp_path / "other")
    tiny_tokenizer().save_pretrained(tmp_path / "other")
    args = train_args(qwen3_dir, tmp_path / "other", qwen3_data, tmp_path / "run")
    assert main([str(a) for a in args]) == 2
    assert "tokenizer differs from the target's" in capsys.readouterr().err
