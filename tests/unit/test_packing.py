"""Prepacked linear maps compute what ``nn.Linear`` computes, and step aside when they must."""

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from d3d.backends.cpu import fused, onednn, packing
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model
from tests.engine.test_async_lossless import PROMPTS, run

pytestmark = pytest.mark.skipif(not packing.available(), reason="no oneDNN linear packing")


def test_packed_linear_matches_and_keeps_the_module():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        want = lin(x)
    hooked = []
    lin.register_forward_hook(lambda m, a, out: hooked.append(out.shape))
    keys = set(lin.state_dict())
    model = nn.Sequential(lin)
    assert packing.pack_linears(model) == 1
    assert model[0] is lin and isinstance(lin, nn.Linear) and type(lin) is packing.PackedLinear
    with torch.inference_mode():
        got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert hooked == [(3, 5, 48)] and set(lin.state_dict()) == keys


def test_one_or_two_rows_read_the_stored_weight_and_more_the_packed_one(monkeypatch):
    lin = nn.Linear(64, 48, bias=False)
    packing.pack_linears(nn.Sequential(lin))
    packed = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        packing.torch.ops.mkldnn, "_linear_pointwise", lambda *a: packed.append(1) or real(*a)
    )
    with torch.inference_mode():
        for rows in (1, packing.SMALL, packing.SMALL + 1, 16):
            x = torch.randn(1, rows, 64)
            torch.testing.assert_close(lin(x), x @ lin.weight.T, rtol=1e-5, atol=1e-5)
    assert len(packed) == 2  # the inputs of SMALL + 1 and 16 rows


def test_gradients_and_changed_weights_use_the_plain_map():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8, bias=False)
    packing.pack_linears(nn.Sequential(lin))
    x = torch.randn(2, 16, requires_grad=True)
    lin(x).sum().backward()  # the plain map: gradients flow
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        lin.weight.mul_(2.0)  # the packed copy is stale now: the plain map runs
        y = lin(x)
    torch.testing.assert_close(y, x @ lin.weight.t())


def test_a_deep_copy_is_a_plain_linear_and_other_layers_are_left_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).double(), nn.ReLU())
    assert packing.pack_linears(model) == 1  # the float64 map stays as it is
    assert type(model[1]) is nn.Linear
    twin = copy.deepcopy(model)
    assert type(twin[0]) is nn.Linear and not hasattr(twin[0], "_packed")
    torch.testing.assert_close(twin[0].weight, model[0].weight)
    assert twin[0].weight.data_ptr() != model[0].weight.data_ptr()


@pytest.mark.parametrize("vllm", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_packed_target_decodes_losslessly(kind, vllm):
    if vllm and not fused.available():
        pytest.skip("vLLM's CPU kernels not installed")
    target = tiny_model(kind, seed=1)
    drafter = D3DDrafter.from_target(tiny_model(kind, seed=7), 2)
    assert packing.pack_linears(target, vllm) > 0 and packing.pack_linears(drafter.lm) > 0
    for prompt in PROMPTS:
        ref, _ = run(target, ArProposer(), prompt)
        out, _ = run(target, SyncProposer(drafter), prompt)
        assert out == ref


# vLLM installed without its kernels fails these tests (d3d.backends.cpu.vllm_kernels).
NO_VLLM = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(NO_VLLM, reason="vLLM is not installed (make setup installs its CPU build)")
def test_vllms_matmul_handler_computes_the_same_map_and_is_not_copied(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    assert packing.pack_linears(nn.Sequential(lin), vllm=True) == 1
    assert lin._handler is not None and lin._packed is None
    calls = []
    ops = onednn.ops()
    real = ops.onednn_mm
    monkeypatch.setattr(ops, "onednn_mm", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        for rows in (1, packing.SMALL + 1, 16):
            x = torch.randn(1, rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert len(calls) == 2  # one row reads the stored weight
    twin = copy.deepcopy(lin)
    assert type(twin) is nn.Linear and not hasattr(twin, "_handler")
