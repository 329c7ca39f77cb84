"""Config validation names the field; sampling builds the distributions both sides share."""

import pytest
import torch

from d3d.config import ConfigError, DecodeConfig, ModelConfig, SamplingConfig
from d3d.sampling import pick, probabilities


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingConfig(temperature=-1), "temperature"),
        (lambda: SamplingConfig(top_p=0), "top_p"),
        (lambda: DecodeConfig(mode="fast"), "mode"),
        (lambda: DecodeConfig(max_new_tokens=0), "max_new_tokens"),
        (lambda: DecodeConfig(block_size=1), "block_size"),
        (lambda: ModelConfig(target=" "), "target"),
        (lambda: ModelConfig(dtype="int8"), "dtype"),
    ],
)
def test_config_errors_name_the_field(make, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        make()


def test_model_config_from_env(monkeypatch):
    monkeypatch.setenv("D3D_TARGET", "Qwen/Qwen3-8B")
    monkeypatch.setenv("D3D_DRAFTER_DEVICE", "cuda:1")
    cfg = ModelConfig.from_env(drafter="self:4")
    assert cfg.target == "Qwen/Qwen3-8B"
    assert cfg.drafter == "self:4"
    assert cfg.resolved_drafter_device == "cuda:1"


def test_probabilities_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingConfig(temperature=1.0))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.05]]), atol=1e-6)
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.1))
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        probabilities(logits, SamplingConfig())


def test_a_vanishing_temperature_samples_the_argmax_not_nan():
    """3e-217 (a client may send it) divides logits past float range: the distribution must
    still be one, all of it on the most likely token."""
    logits = torch.tensor([[1.5, 3.0, -2.0, 2.9]])
    p = probabilities(logits, SamplingConfig(temperature=3.5e-217))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert pick(logits[0], SamplingConfig(temperature=1e-300, seed=1), None) == 1


def test_a_vanishing_top_p_keeps_the_most_likely_token_not_nan():
    """5e-324 rounds to 0 in float32, so every token's mass before it 'reached' top_p and all
    were dropped (0 / 0 = NaN, a 500 found by the schema fuzzer): the most likely token stays,
    ties included at the first place only."""
    cfg = SamplingConfig(temperature=5e-324, top_p=5e-324)
    p = probabilities(torch.zeros(2, 7), cfg)  # all tied: one token left per row
    assert torch.isfinite(p).all() and torch.equal(p.sum(-1), torch.ones(2))
    assert torch.equal((p > 0).sum(-1), torch.ones(2, dtype=torch.long))
    logits = torch.tensor([[1.5, 3.0, -2.0, 2.9]])
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=5e-324))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_pick_greedy_is_argmax():
    assert pick(torch.tensor([0.1, 3.0, 2.0]), SamplingConfig(), None) == 1


def test_serve_settings_read_the_copy_switch(monkeypatch):
    from app.settings import ServeSettings

    monkeypatch.setenv("D3D_COPY", "off")
    assert ServeSettings.from_env().copy is False
    assert ServeSettings.from_env(copy=True).copy is True  # a flag wins
    monkeypatch.setenv("D3D_COPY", "1")
    assert ServeSettings.from_env().copy is True
    monkeypatch.setenv("D3D_COPY", "maybe")
    with pytest.raises(ConfigError, match="D3D_COPY: cannot read 'maybe' as on/off"):
        ServeSettings.from_env()
