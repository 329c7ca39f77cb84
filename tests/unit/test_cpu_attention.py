"""vLLM's CPU attention kernel over the slabs: each row's attention as if alone, and a model that
uses it decodes losslessly."""

import copy
import functools
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from d3d.backends.cpu import CpuBackend, fused
from d3d.backends.cpu import attention as cpu_attention
from d3d.backends.cpu.groups import SPLIT_WIDTH, attend_group
from d3d.backends.kv import GROW, KvHooks, RowKV
from d3d.backends.ragged import ragged_attention
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.model.drafter import D3DDrafter
from tests.engine.test_async_lossless import PROMPTS, run
from tests.unit.test_slabs import assert_each_row_alone

# vLLM installed without its kernels fails these tests (d3d.backends.cpu.vllm_kernels).
NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = pytest.mark.skipif(
    NO_VLLM, reason="vLLM is not installed (make setup installs its CPU build)"
)

D = 32  # the kernel's smallest head dim


def model_d32(seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=4 * D,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=255,
        bos_token_id=0,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kernel_writes", [False, True])  # the keys indexed in, or written by vLLM
@pytest.mark.parametrize("widths", [[1, 1, 3, 1, 3], [1, SPLIT_WIDTH + 8, 1, 3], [1, 1, 1]])
def test_groups_attend_as_each_row_alone(widths, kernel_writes):
    isa = cpu_attention._isa(torch.float32, D)
    assert isa is not None

    class Layer(torch.nn.Module):
        layer_idx = 0

    layer = Layer()
    setattr(layer, cpu_attention.MODULE_FLAG, isa)
    write = functools.partial(cpu_attention.write, isa=isa) if kernel_writes else None
    kv = RowKV(1, 2, D, torch.float32, "cpu", 64 * GROW, True, KvHooks(attend_group, write))
    rows = [kv.open(4 * GROW) for _ in widths]
    torch.manual_seed(0)
    with torch.inference_mode():
        for i, r in enumerate(rows[:-1]):  # the last row: a prompt's first chunk
            n = 5 + 7 * i
            kv.begin([r], [n])
            k = torch.randn(1, 2, n, D)
            kv.update(k, k + 1, 0)
            kv.commit(r, n)
        pos, batch = kv.begin(rows, widths)
        if kernel_writes:  # the kernel takes any widths: one call for the slab's rows
            assert len(batch.groups) == len({g.slab for g in batch.groups})
        n = pos.shape[1]
        new_k = torch.randn(1, 2, n, D)
        kv.update(new_k, new_k + 1, 0)
        q = torch.randn(1, n, 4, D).transpose(1, 2)  # [1, Hq, N, D] over [1, N, Hq, D]
        out = ragged_attention(layer, q, new_k, new_k + 1, batch)  # [1, N, Hq, D]
        assert_each_row_alone(out, q, rows, widths, atol=1e-5)


def test_a_model_on_vllms_attention_reads_its_own_logits_and_decodes_losslessly():
    target = model_d32(1)
    twin = copy.deepcopy(target)
    assert fused.fuse(target) > 0 and cpu_attention.paged_attention(target)
    ids = [list(range(3, 40)), [7] * 9]
    with torch.inference_mode():
        got, want = (CpuBackend().target(m, 4096) for m in (target, twin))
        rows = [[got.kv.open(64) for _ in ids], [want.kv.open(64) for _ in ids]]
        assert all(r.slab is None for r in rows[0])
        a = got.forward(rows[0], ids)
        assert rows[0][0].slab.keys_t and not rows[1][0].slab
        b = want.forward(rows[1], ids)
        assert not rows[1][0].slab.keys_t
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    drafter = D3DDrafter.from_target(model_d32(7), 1)
    for prompt in PROMPTS:
        ref, _ = run(target, ArProposer(), prompt)
        out, _ = run(target, SyncProposer(drafter), prompt)
        assert out == ref
