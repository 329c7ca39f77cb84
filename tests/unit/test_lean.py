"""The lean forward (d3d.backends.cpu.lean) computes the model's own logits over the engine's rows, and
decoding through it stays lossless; a model it does not fit runs its own forward."""

import importlib.util

import pytest
import torch

from d3d.backends.cpu import CpuBackend, fused, lean
from d3d.backends.reference import ReferenceBackend
from d3d.backends.target import BatchTarget
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model
from tests.engine.test_async_lossless import PROMPTS, run

# vLLM installed without its kernels fails these tests (d3d.backends.cpu.vllm_kernels).
NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = pytest.mark.skipif(
    NO_VLLM, reason="vLLM is not installed (make setup installs its CPU build)"
)


def fused_model(kind: str, seed: int = 1):
    model = tiny_model(kind, seed=seed)
    fused.fuse(model)
    assert lean.attach(model) == 1
    return model


def steps(target: BatchTarget, seed: int = 0) -> list[torch.Tensor]:
    """Three rows over three steps: prompt chunks of several widths, then verify-like widths
    and plain steps, past the rotary table's first size."""
    rows = [target.kv.open(64) for _ in range(3)]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for widths in ((9, 4, 1), (3, 1, 5), (1, 1, 1)):
        ids = [torch.randint(target.vocab_size, (w,), generator=gen).tolist() for w in widths]
        keep = [None, [0], list(range(widths[2]))]
        out += target.forward(rows, ids, keep)
        for row, w in zip(rows, widths, strict=True):
            target.kv.commit(row, w)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_lean_logits_are_the_models_own(kind, monkeypatch):
    monkeypatch.setattr(lean, "TABLE_ROWS", 4)  # the table must grow within the sample
    model = fused_model(kind)
    fast, own = CpuBackend().target(model, 512), ReferenceBackend().target(model, 512)
    assert fast.fast is lean.of(model) and own.fast is None
    calls = []
    real = lean.LeanDecoder.__call__
    monkeypatch.setattr(lean.LeanDecoder, "__call__", lambda *a: calls.append(1) or real(*a))
    for got, want in zip(steps(fast), steps(own), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(calls) == 3 and fast.fast.table.shape[0] >= 14


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decoding_through_the_lean_forward_is_lossless(kind, monkeypatch):
    target = fused_model(kind)
    calls = []
    real = lean.LeanDecoder.__call__
    monkeypatch.setattr(lean.LeanDecoder, "__call__", lambda *a: calls.append(1) or real(*a))
    drafter = D3DDrafter.from_target(tiny_model(kind, seed=7), 2)
    for prompt in PROMPTS:
        ref, _ = run(target, ArProposer(), prompt)
        out, _ = run(target, SyncProposer(drafter), prompt)
        assert out == ref
    assert calls  # the decoding ran through it


def test_a_disagreeing_lean_forward_is_dropped(monkeypatch):
    model = fused_model("llama")
    dec = lean.of(model)
    monkeypatch.setattr(dec, "eps", 0.5)  # wrong norms: logits no longer the model's own
    assert CpuBackend().target(model, 256).fast is None and lean.of(model) is None


def test_models_it_does_not_fit_keep_their_forward():
    model = tiny_model("llama", seed=1)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    assert lean.attach(model) == 0 and lean.of(model) is None
    assert lean.attach(tiny_model("llama", seed=1).double()) == 0


def test_a_deep_copy_carries_no_lean_forward():
    import copy

    model = fused_model("llama")
    assert lean.of(copy.deepcopy(model)) is None
