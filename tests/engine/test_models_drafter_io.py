"""Loading errors, drafter checkpoints, and the fail-fast checks at load time."""

import json

import pytest
import torch

from d3d.config import ModelConfig
from d3d.engine import Engine, build_drafter, check_device
from d3d.model.drafter import D3DDrafter, DrafterError
from d3d.model.load import LoadedModel, ModelLoadError, load_target
from tests.conftest import tiny_model, tiny_tokenizer


def test_missing_paths_give_one_line_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_target(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_target(str(tmp_path / "model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_target(str(tmp_path / "empty"))


def test_unreadable_model_folder(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_target(str(d))


def test_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_target(str(bad))


def test_local_directory_round_trip(tmp_path):
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded = load_target(str(tmp_path / "m"))
    assert loaded.vocab_size == model.config.vocab_size
    assert loaded.eos_token_ids == {model.config.vocab_size - 1}
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits)
    assert loaded.tokenizer("w1 w2")["input_ids"] == [1, 2]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_checkpoint_round_trip_keeps_outputs_and_leaves_out_shared_tensors(tmp_path, kind):
    target = tiny_model(kind, seed=2, layers=3)
    drafter = D3DDrafter.from_target(target, [0, 2], block_size=8)
    with torch.no_grad():
        drafter.mask_embedding.add_(0.5)  # not the default init, so loading must restore it
    drafter.save(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "drafter.json").read_text())
    assert meta["meta"]["layers"] == [0, 2]
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "ckpt" / "drafter.safetensors")).keys()
    assert "mask_embedding" in keys
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)

    loaded = D3DDrafter.load(tmp_path / "ckpt", target)
    assert loaded.block_size == 8
    ids = [5, 6, 7, 8, 9]
    a, b = drafter.session().draft(ids), loaded.session().draft(ids)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(loaded.mask_embedding, drafter.mask_embedding)


def test_int8_checkpoint_rebuilds_its_matrices_within_half_a_step(tmp_path, monkeypatch):
    from d3d.model import checkpoint

    monkeypatch.setattr(checkpoint, "INT8_MIN_SIZE", 1)  # the tiny matrices too
    w = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]  # rows of any scale
    q = checkpoint.quantize_int8({"w": w, "norm": torch.ones(48)})
    assert q["w"].dtype == torch.int8 and "norm" + checkpoint.INT8_SCALE not in q
    back = checkpoint.dequantize_int8(q)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((back["w"] - w).abs() <= step / 2 + 1e-6).all()
    assert set(back) == {"w", "norm"}

    target = tiny_model("llama", seed=3, layers=2)
    drafter = D3DDrafter.from_target(target, [0, 1], block_size=8)
    drafter.save(tmp_path / "q8", int8=True)
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "q8" / "drafter.safetensors"))
    assert any(v.dtype == torch.int8 for v in stored.values())
    loaded = D3DDrafter.load(tmp_path / "q8", target)
    for name, p in drafter.named_parameters():
        if "embed_tokens" in name or "lm_head" in name:
            continue
        torch.testing.assert_close(dict(loaded.named_parameters())[name], p, atol=0.05, rtol=0.02)


def test_drafter_vocab_must_match_target(tmp_path):
    D3DDrafter.from_target(tiny_model("llama", vocab=101), 1).save(tmp_path / "ckpt")
    with pytest.raises(DrafterError, match="vocabulary"):
        D3DDrafter.load(tmp_path / "ckpt", tiny_model("llama", vocab=97))


def test_bad_drafter_specs(tmp_path):
    target = LoadedModel(model=tiny_model("llama"), tokenizer=None, spec="tiny")
    with pytest.raises(DrafterError, match="not found"):
        build_drafter(str(tmp_path / "missing"), target)
    with pytest.raises(DrafterError, match="not a drafter checkpoint"):
        build_drafter(str(tmp_path), target)
    with pytest.raises(DrafterError, match="bad drafter spec"):
        build_drafter("self:x", target)
    with pytest.raises(DrafterError, match="layers must be"):
        build_drafter("self:0,9", target)
    assert len(build_drafter("self:0,1", target).meta.layers) == 2
    # No trained drafter for this target: speculation is off, not an untrained drafter.
    assert build_drafter("default", target) is None
    assert build_drafter("none", target) is None


def test_engine_rejects_a_drafter_of_another_vocabulary():
    target = LoadedModel(model=tiny_model("llama", vocab=101), tokenizer=None, spec="tiny")
    other = D3DDrafter.from_target(tiny_model("llama", vocab=97), 1)
    with pytest.raises(DrafterError, match="vocabulary"):
        Engine(target, other)


def test_missing_devices_fail_fast():
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            check_device("cuda:1")
    with pytest.raises(ModelLoadError, match="unknown device"):
        check_device("tpu")
    with pytest.raises(ModelLoadError):
        Engine.from_config(ModelConfig(target_device="tpu"))


def test_a_drafter_with_its_own_tied_embeddings_round_trips(tmp_path):
    """A drafter from another model (not sharing the target's tensors) stores a tied head once."""
    from d3d.model.drafter import DrafterMeta

    target = tiny_model("llama", seed=2)
    lm = tiny_model("llama", seed=9)  # tie_word_embeddings=True
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    meta = DrafterMeta(base="other", layers=(0, 1), shared_embeddings=False, vocab_size=101)
    drafter = D3DDrafter(lm, meta)
    drafter.save(tmp_path / "own")
    loaded = D3DDrafter.load(tmp_path / "own", target)
    assert loaded.lm.get_output_embeddings().weight is loaded.lm.get_input_embeddings().weight
    torch.testing.assert_close(
        loaded.lm.get_input_embeddings().weight, lm.get_input_embeddings().weight
    )
    ids = [5, 6, 7, 8]
    assert torch.equal(loaded.session().draft(ids).tokens, drafter.session().draft(ids).tokens)


def test_a_drafter_on_another_device_copies_the_shared_tensors_instead_of_moving_them():
    """Two-device setups: placing the drafter elsewhere must leave the target where it is."""
    target = tiny_model("llama", seed=2, tie=True)
    drafter = D3DDrafter.from_target(target, 1, device="meta")
    assert target.get_input_embeddings().weight.device.type == "cpu"
    assert target.get_output_embeddings().weight.device.type == "cpu"
    assert drafter.lm.get_input_embeddings().weight.device.type == "meta"
    assert drafter.lm.get_output_embeddings().weight.device.type == "meta"
    assert drafter.lm.get_output_embeddings() is not target.get_output_embeddings()
    same = D3DDrafter.from_target(target, 1)  # same device: shared, not copied
    assert same.lm.get_input_embeddings() is target.get_input_embeddings()
