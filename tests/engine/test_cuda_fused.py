"""The cuda backend's fused norms and rotation (d3d.backends.cuda.fused): taken where they compute
what the model's own code does, refused where a model's norm or rule is of another form, and a
decode step that launches few operations a layer."""

from __future__ import annotations

import collections
import contextlib
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from d3d.backends.cuda import CudaBackend, CudaTarget
from d3d.backends.cuda.forward import StepInputs
from d3d.backends.cuda.fused import fuse_projections, joined, norm_of, rope_of, rotate_together
from d3d.backends.cuda.kv import MIN_CAPACITY, StaticKV
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_norms_and_rotation_are_fused_and_agree(kind, dtype):
    model = tiny_model(kind, seed=4).to(dtype)
    layer = model.model.layers[0]
    norm = layer.input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not the ones it starts with
    fused = norm_of(norm)
    assert fused is not norm
    x = torch.randn(3, model.config.hidden_size).to(dtype)
    torch.testing.assert_close(fused(x), norm(x), **_tol(dtype))
    a = layer.self_attn
    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    rope = rope_of(_rule(a), model.model.rotary_emb, dtype, hq, hkv, a.head_dim)
    assert rope is rotate_together
    q, k = torch.randn(4, hq, a.head_dim).to(dtype), torch.randn(4, hkv, a.head_dim).to(dtype)
    cos, sin = model.model.rotary_emb(q[None, :, 0], torch.tensor([[0, 7, 100, 3000]]))
    want = _rule(a)(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got = rope(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w[0].transpose(0, 1), rtol=0, atol=0)


def test_a_norm_or_rule_of_another_form_keeps_the_models_own_code():
    gemma = GemmaRMSNorm(32)  # scales by 1 + weight
    assert norm_of(gemma) is gemma
    model = tiny_model("qwen3", seed=5)
    a = model.model.layers[0].self_attn

    def interleaved(q, k, cos, sin):  # pairs (0, 1), (2, 3), ... rotated: not rotate_half's
        def turn(x):
            return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)

        c, s = cos[:, None], sin[:, None]
        return q * c + turn(q) * s, k * c + turn(k) * s

    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    rope = rope_of(interleaved, model.model.rotary_emb, torch.float32, hq, hkv, a.head_dim)
    assert rope is not rotate_together


def _storages(model) -> dict[int, int]:
    return {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }


def test_projections_laid_out_in_one_storage_cost_no_memory_and_keep_every_value():
    model = tiny_model("qwen3", seed=7, layers=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bytes_before = sum(_storages(model).values())
    assert fuse_projections(model) == 6  # q, k, v and gate, up in each of 3 layers
    assert sum(_storages(model).values()) == bytes_before  # the old tensors are gone
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    a = model.model.layers[1].self_attn
    qkv = joined(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
    want = [before[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert qkv is not None and torch.equal(qkv, torch.cat(want))
    assert fuse_projections(model) == 0  # already laid out
    # a drafter sharing the layers, built after, shares the layout: no second copy
    drafter = D3DDrafter.from_target(model, 2, base="tiny", block_size=6, share=True)
    assert _storages(drafter.lm).keys() <= _storages(model).keys()
    d = drafter.lm.model.layers[0].self_attn
    assert joined(d.q_proj.weight, d.k_proj.weight, d.v_proj.weight) is not None
    assert joined(a.q_proj.weight, a.v_proj.weight) is None  # not one after another


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_the_fused_step_gives_the_model_own_forms_logits(kind):
    """The GPU check times the step with the model's own forms beside the fused one: both
    compute the same logits."""
    model = tiny_model(kind, seed=8)
    CudaBackend(graphs=False).prepare(model)
    kv = [StaticKV.shaped(model, 4 * MIN_CAPACITY, 2) for _ in "ab"]
    fused = CudaTarget(model, kv[0], block=6, graphs=False)
    own = CudaTarget(model, kv[1], block=6, graphs=False, fused=False)
    assert fused.step.qkv[0] is not None and own.step.qkv[0] is None
    rows = {id(t): [t.kv.open(100) for _ in range(2)] for t in (fused, own)}
    for widths in ((5, 9), (1, 1), (6, 6)):
        ids = [list(range(3, 3 + w)) for w in widths]
        a, b = (t.forward(rows[id(t)], ids) for t in (fused, own))
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        for t in (fused, own):
            for row, w in zip(rows[id(t)], widths, strict=True):
                t.kv.commit(row, w)
    assert fused.counts["decode"] == own.counts["decode"] == 2


def test_a_kernel_that_disagrees_or_raises_is_not_taken(monkeypatch):
    """The step takes a Triton kernel only where its sample agrees with the torch form it
    replaces (kernels that compute something else, or fail to launch, stand in here)."""
    import d3d.backends.cuda.taken as taken

    def wrong_norm(h, delta, weight, eps):
        h += delta
        return h  # no norm

    def fails(*args):
        raise RuntimeError("no kernel image for this device")

    fake = types.SimpleNamespace(add_norm=wrong_norm, silu_mul=fails, qk_in=fails, attend=fails)
    monkeypatch.setattr(taken, "kernels_for", lambda device: fake)
    model = tiny_model("qwen3", seed=8)
    CudaBackend(graphs=False).prepare(model)
    kv = StaticKV.shaped(model, 4 * MIN_CAPACITY, 2)
    k = CudaTarget(model, kv, block=6, graphs=False).step.kernels
    assert k.module is fake and not k.add_norm and not k.attend
    assert k.qk_in == k.silu_mul == [False, False]
    # a kernel that agrees is taken
    fake.silu_mul = lambda gu: F.silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :]
    k = CudaTarget(model, kv, block=6, graphs=False).step.kernels
    assert k.silu_mul == [True, True] and not k.add_norm


def test_the_kernels_are_looked_for_on_a_gpu_and_can_be_turned_off(monkeypatch):
    pytest.importorskip("triton")
    from d3d.backends.cuda.taken import kernels_for

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels_for(torch.device("cpu")) is None  # Triton cannot run here
    assert kernels_for(torch.device("cuda", 0)).__name__ == "d3d.backends.cuda.kernels"
    monkeypatch.setenv("D3D_CUDA_KERNELS", "0")
    assert kernels_for(torch.device("cuda", 0)) is None


class _Ops(TorchDispatchMode):
    """Operations that run a kernel (views are free), counted."""

    FREE = frozenset({"view", "_unsafe_view", "transpose", "permute", "expand", "narrow", "slice",
            "split", "split_with_sizes", "select", "unsqueeze", "squeeze", "t", "alias",
            "as_strided", "unbind", "detach", "_reshape_alias"})  # fmt: skip

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in self.FREE:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _ops_a_step(layers: int, also=None) -> collections.Counter:
    """Operations a plain 2-row step runs; ``also(target, count)``: a context that counts
    more (the Triton kernels' launches, interpreted_kernels.py)."""
    model = tiny_model("qwen3", seed=6, layers=layers)
    CudaBackend(graphs=False).prepare(model)  # the projections laid out for one product each
    t = CudaBackend(graphs=False, trust=True).target(model, 8 * MIN_CAPACITY, rows=4, block=6)
    x = StepInputs.empty(2, 1, torch.device("cpu"))
    x.fill(torch.tensor([[1], [2]]), torch.tensor([3, 4]))
    with _Ops() as ops, also(t, ops.count) if also else contextlib.nullcontext():
        t.step(x, 256)
    return ops.count


def test_a_decode_step_launches_few_operations_a_layer():
    """Each layer of a Qwen3 step: 4 products (q, k and v in one, o, gate and up in one,
    down), 4 fused norms, a rotation of q and k together, 2 KV writes, one attention call and
    its layout copies, the residual adds and the MLP's activation: 24 here (58 before the
    fusing, most of them the norms' and rotation's elementwise chains)."""
    two, four = _ops_a_step(2), _ops_a_step(4)
    per_layer = (four - two).total() / 2
    assert per_layer <= 26, four - two
    assert (four - two)["rms_norm"] == 2 * 4  # the norms fused, four a layer
    assert (four - two)["linear"] == 2 * 4  # the projections in four products a layer


def _rule(attn):
    import sys

    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def _tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
