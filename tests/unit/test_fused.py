"""vLLM's fused CPU kernels compute what the model's own code computes, only for the fused model,
and step aside where they must."""

import importlib.util

import pytest
import torch
from torch import nn

from d3d.backends.cpu import fused
from d3d.config import ModelConfig
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model
from tests.engine.test_async_lossless import PROMPTS, run

# vLLM installed without its kernels fails these tests (d3d.backends.cpu.vllm_kernels).
NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = pytest.mark.skipif(
    NO_VLLM, reason="vLLM is not installed (make setup installs its CPU build)"
)

IDS = torch.tensor([[1, 5, 9, 22, 7, 3, 3, 40, 41, 2]])


def logits(model: nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=IDS).logits


def counting_rope(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = fused._rope
    monkeypatch.setattr(fused, "_rope", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_fused_model_computes_its_own_logits_and_decodes_losslessly(kind, monkeypatch):
    target = tiny_model(kind, seed=1)
    want = logits(target)
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in target.modules())
    assert fused.fuse(target) == norms + target.config.num_hidden_layers  # norms + attentions
    rope = counting_rope(monkeypatch)
    torch.testing.assert_close(logits(target), want, rtol=1e-4, atol=1e-4)
    assert len(rope) == target.config.num_hidden_layers  # the fused rotary ran in every layer
    drafter = D3DDrafter.from_target(tiny_model(kind, seed=7), 2)
    for prompt in PROMPTS:
        ref, _ = run(target, ArProposer(), prompt)
        out, _ = run(target, SyncProposer(drafter), prompt)
        assert out == ref


def test_another_model_of_the_same_kind_keeps_pytorchs_code(monkeypatch):
    other = tiny_model("llama", seed=2)
    before = logits(other)
    assert fused.fuse(tiny_model("llama", seed=1)) > 0
    rope = counting_rope(monkeypatch)
    assert torch.equal(logits(other), before)  # bit for bit
    assert rope == [] and not any("forward" in m.__dict__ for m in other.modules())


def test_gradients_take_the_models_own_code():
    model = tiny_model("llama", seed=1)
    fused.fuse(model)
    model.requires_grad_(True)
    model(input_ids=IDS).logits.sum().backward()  # the kernels have no backward
    assert all(p.grad is not None for p in model.parameters() if p.dim() == 2)


class OnePlusRMSNorm(nn.Module):  # Gemma's form: (1 + weight) * x / rms(x)
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight) * x * rms


def test_a_norm_of_another_form_keeps_its_own_forward():
    norm = OnePlusRMSNorm(64)
    assert fused._is_rms_norm(norm) and fused._fuse_norm(norm) == 0
    assert "forward" not in norm.__dict__


def test_without_vllm_nothing_changes(monkeypatch):
    monkeypatch.setattr(fused, "available", lambda: False)
    model = tiny_model("qwen3", seed=1)
    assert fused.fuse(model) == 0 and not any("forward" in m.__dict__ for m in model.modules())


def test_the_engine_fuses_unless_told_not_to(monkeypatch):
    monkeypatch.setenv("D3D_FUSE", "0")
    assert ModelConfig.from_env().fuse is False
    monkeypatch.setenv("D3D_FUSE", "1")
    assert ModelConfig.from_env().fuse is True
