"""The cuda backend's Triton kernels (d3d.backends.cuda.kernels) run by Triton's interpreter on
the CPU: taken where their samples agree, and a step through them equal to the step through the
torch forms they replace — logits, keys and values, plain, verify and eager steps (attention
split over the keys in the plain and verify steps), the packed drafter's blocks — in float32
and float16. (Not bfloat16: the interpreter rounds a float32 to
bfloat16 by truncation, where a GPU rounds to nearest; on a GPU the samples decide.)

Not collected by the suite's own run (Triton reads ``TRITON_INTERPRET`` once, when it is first
imported, and the rest of the suite must not run interpreted): ``test_cuda_kernels.py`` runs
this file in a pytest of its own with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import collections
import contextlib
import os

import pytest
import torch

from d3d.backends.cuda import CudaBackend, CudaTarget
from d3d.backends.cuda.drafter import PackedDrafter, PackedPlan
from d3d.backends.cuda.kv import MIN_CAPACITY, StaticKV
from d3d.backends.cuda.rehearsal import Rehearsal
from d3d.backends.cuda.taken import Kernels
from d3d.model.adapters import AdapterConfig
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model
from tests.engine.test_cuda_fused import _ops_a_step

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_cuda_kernels.py"
)
DTYPES = [torch.float32, torch.float16]


def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 2e-3}


def _pair(
    kind: str, dtype: torch.dtype, layers: int = 2, graphs: bool = False
) -> tuple[CudaTarget, CudaTarget]:
    """A target through the kernels (``graphs``: its steps rehearsed as graphs would run them,
    d3d.backends.cuda.rehearsal) and one through the torch forms, eager."""
    model = tiny_model(kind, seed=8, layers=layers).to(dtype)
    CudaBackend(graphs=False).prepare(model)
    kv = [StaticKV.shaped(model, 4 * MIN_CAPACITY, 2) for _ in "ab"]
    tri = CudaTarget(model, kv[0], block=6, graphs=graphs)
    own = CudaTarget(model, kv[1], block=6, graphs=False, kernels=False)
    return tri, own


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_is_taken_where_its_sample_agrees(kind, dtype):
    tri, own = _pair(kind, dtype, layers=3)
    k = tri.step.kernels
    assert k.module is not None and k.add_norm and k.attend
    assert k.qk_in == [True] * 3 and k.silu_mul == [True] * 3
    assert own.step.kernels.module is None and not any(own.step.kernels.qk_in)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_through_the_kernels_equal_steps_through_the_torch_forms(kind, dtype):
    tri, own = _pair(kind, dtype)
    rows = {id(t): [t.kv.open(100) for _ in range(2)] for t in (tri, own)}
    # a prompt (eager, gathered slots), plain steps, a verify of 6, steps again
    for widths in ((5, 9), (1, 1), (6, 6), (1, 1), (2, 6)):
        ids = [[(7 * j + w) % 90 + 2 for j in range(w)] for w in widths]
        a, b = (t.forward(rows[id(t)], ids) for t in (tri, own))
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **_tol(dtype))
            assert x.argmax(-1).tolist() == y.argmax(-1).tolist()
        for t in (tri, own):
            for row, w in zip(rows[id(t)], widths, strict=True):
                t.kv.commit(row, w)
    assert tri.counts == own.counts and tri.counts["decode"] >= 3
    for ka, kb in zip(tri.kv.keys + tri.kv.values, own.kv.keys + own.kv.values, strict=True):
        torch.testing.assert_close(ka, kb, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adapters", [False, True])
def test_the_packed_drafter_drafts_the_same_blocks_through_the_kernels(dtype, adapters):
    """With gated adapters (hooks on every projection) only the residual add and norm run as a
    kernel: the products keep their module calls, so the adapters act."""
    target = tiny_model("qwen3", seed=2)
    d = D3DDrafter.from_target(
        target, 2, block_size=5, adapter=AdapterConfig(rank=4) if adapters else None
    )
    if adapters:
        with torch.no_grad():
            for lora in d.adapters.lora.values():
                lora.B.normal_(0, 0.5)
    d = d.to(dtype)
    CudaBackend(graphs=False).prepare_drafter(d.lm)
    plan = PackedPlan(graphs=False, rows=2, kv_tokens=1024)
    packs = [PackedDrafter(d, plan) for _ in "ab"]
    packs[1].step.core.kernels = Kernels.none(2)
    k = packs[0].step.core.kernels
    assert k.add_norm and k.attend and k.qk_in == k.silu_mul == [not adapters] * 2
    prefixes = [[3, 8, 13, 21, 5, 6], [(5 * i) % 90 + 2 for i in range(20)]]
    none = torch.zeros(2, 0, dtype=torch.long)
    outs = []
    for p in packs:
        rows = [p.open(100) for _ in prefixes]
        p.run(rows, [x[:-1] for x in prefixes], none, none)
        visible = torch.tensor([[len(x) - 1] for x in prefixes])
        anchors = torch.tensor([[x[-1]] for x in prefixes])
        outs.append(p.run(rows, [[] for _ in prefixes], visible, anchors).blocks)
    torch.testing.assert_close(outs[0], outs[1], **_tol(dtype))


def test_the_packed_drafter_meets_one_shape_per_step_form_whatever_the_context():
    """Through the split attention (a bound and a band a query) the keys a packed step attends
    are no part of its shape: rows drafting (a chain and two blocks) through contexts that
    SDPA's steps attend in 256 and 512 keys meet one shape, their blocks still the torch forms'
    (whose steps meet two), each step held to its graph's first (rehearsed)."""
    target = tiny_model("qwen3", seed=2)
    d = D3DDrafter.from_target(target, 2, block_size=5)
    CudaBackend(graphs=False).prepare_drafter(d.lm)
    plan = PackedPlan(graphs=True, rows=2, kv_tokens=2048)
    packs = [PackedDrafter(d, plan) for _ in "ab"]
    assert isinstance(packs[0].runner, Rehearsal)
    packs[1].step.core.kernels = Kernels.none(2)
    assert packs[0].step.core.reads_lengths and not packs[1].step.core.reads_lengths
    gen = torch.Generator().manual_seed(1)
    rows = [[p.open(480) for _ in range(2)] for p in packs]
    for grow in (100, 1, 150, 1, 150, 1):  # a long chain (eager), then a packed step
        chains = [torch.randint(2, 90, (grow + i,), generator=gen).tolist() for i in range(2)]
        if grow == 1:  # a block's chain and two blocks a row, visible inside the chain
            chains = [torch.randint(2, 90, (5,), generator=gen).tolist() for _ in range(2)]
            k = torch.randint(0, 6, (2, 2), generator=gen)
            anchors = torch.randint(2, 90, (2, 2), generator=gen)
        outs = []
        for p, rs in zip(packs, rows, strict=True):
            if grow == 1:
                visible = torch.tensor([[r.length] for r in rs]) + k
                outs.append(p.run(rs, chains, visible, anchors).blocks)
            else:  # the long chains through the torch forms (the interpreter is slow)
                none = torch.zeros(2, 0, dtype=torch.long)
                taken, p.step.core.kernels = p.step.core.kernels, Kernels.none(2)
                p.run(rs, chains, none, none)
                p.step.core.kernels = taken
        if outs:
            torch.testing.assert_close(outs[0], outs[1], **_tol(torch.float32))
    assert packs[0].counts == packs[1].counts == {"packed": 3, "eager": 3}
    assert packs[0].runner.shapes == 1 and packs[1].runner.shapes == 2


def test_the_checks_drafter_stage_times_the_round_with_sdpa_beside_the_split_kernel(monkeypatch):
    from d3d.tools import gpu_stages
    from d3d.tools.gpu_stages import drafter_rounds
    from d3d.worker.packed_check import Verdict

    # the packed sample's blocks through the kernels: the test above (the interpreter is slow)
    monkeypatch.setattr(gpu_stages, "verdict_of", lambda d, plan: Verdict(0.0, 1e-4))
    d = D3DDrafter.from_target(tiny_model("qwen3", seed=2), 1, block_size=16)
    out = drafter_rounds(d, context=20, repeats=1, branches=2)
    assert out["kernels"]["attend"] and out["packed_steps"]["packed"] >= 2
    assert out["packed_2_branches_sdpa_ms"] > 0 and out["sdpa_over_split"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_graph_per_rows_and_width_serves_every_context(dtype):
    """Through the split attention the keys a step attends are no part of its shape: every
    shape is met up front (``capture``), and rows read through contexts that SDPA's steps
    attend in 256 and 512 keys meet no new one, their logits still the torch forms' (whose
    steps do meet them) with each step held to its graph's first (rehearsed)."""
    tri, own = _pair("qwen3", dtype, graphs=True)
    assert tri.step.reads_lengths and not own.step.reads_lengths
    assert tri.capture() == len(tri.buckets) * 2 and own.capture() == 0
    met = tri.runner.shapes
    rows = {id(t): [t.kv.open(500) for _ in range(2)] for t in (tri, own)}
    for widths in ((40, 3), (1, 1), (260, 300), (6, 1), (100, 150), (1, 6), (1, 1)):
        ids = [[(3 * j + w) % 90 + 2 for j in range(w)] for w in widths]
        a, b = (t.forward(rows[id(t)], ids) for t in (tri, own))
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **_tol(dtype))
        for t in (tri, own):
            for row, w in zip(rows[id(t)], widths, strict=True):
                t.kv.commit(row, w)
    assert tri.runner.shapes == met  # own: (T 1, n 256), (6, 512), (1, 512)
    assert own.runner.shapes == 3
    assert tri.counts == own.counts and tri.counts["decode"] == 4
    assert tri.capture() == 0  # rows are open: their slots' keys are not a warm-up's to write


def _launches_a_step(layers: int) -> collections.Counter:
    """Operations a plain 2-row step launches: torch's (views free) and the Triton kernels'."""
    return _ops_a_step(layers, lambda t, count: _counting(t.step.kernels.module, count))


@contextlib.contextmanager
def _counting(module, count: collections.Counter):
    names = ("add_norm", "qk_in", "silu_mul", "attend")
    saved = {n: getattr(module, n) for n in names}

    def counted(name):
        def call(*args):  # one launch; what the interpreter runs inside it is not counted
            before = count.copy()
            out = saved[name](*args)
            count.clear()
            count.update(before)
            count[name] += 2 if name == "attend" else 1  # attention: a split and a join kernel
            return out

        return call

    try:
        for n in names:
            setattr(module, n, counted(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def test_a_step_through_the_kernels_launches_about_half_the_operations_a_layer():
    """A Qwen3 layer: 4 products, qk_in, attention split over the keys and joined (2 kernels)
    and its output's layout, 2 add_norm and silu_mul: 11 launches (24 operations through the
    torch forms, test_cuda_fused.py); and no attention mask is built."""
    two, four = _launches_a_step(2), _launches_a_step(4)
    per_layer = four - two
    assert per_layer.total() / 2 <= 11, per_layer
    assert per_layer["attend"] == 2 * 2 and per_layer["scaled_dot_product_attention"] == 0
    assert two["masked_fill_"] == 0
    assert per_layer["add_norm"] == 2 * 2 and per_layer["linear"] == 2 * 4
    assert per_layer["qk_in"] == per_layer["silu_mul"] == 2
    assert per_layer["rms_norm"] == per_layer["index_put_"] == per_layer["cat"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_attention_equals_sdpa_with_the_rows_mask(dtype, splits):
    """Rows of 1 and 6 queries a key head, some chunks past every key a row sees; rows of 40
    queries a key head (two and three tiles of 64, at G = 2 and 4) that each see a prefix and a band
    (the drafter's blocks), some bands inside the prefix, some empty."""
    from d3d.backends.cuda import kernels

    gen = torch.Generator().manual_seed(splits)
    cases = [(1, 1, 4, 2, 16, 256, False), (3, 6, 2, 2, 16, 320, False),
             (2, 1, 2, 4, 32, 512, False), (1, 40, 2, 1, 16, 192, True),
             (1, 40, 4, 1, 16, 128, True)]  # fmt: skip
    for b, t, g, hkv, d, n, banded in cases:
        keys, values = (torch.randn(b + 1, hkv, 640, d, generator=gen).to(dtype) for _ in "kv")
        q = torch.randn(b, hkv, g * t, d, generator=gen).to(dtype)
        lengths = torch.randint(0, n - t, (b,), generator=gen)
        limit = lengths[:, None] + torch.arange(1, t + 1)
        band = None
        if banded:
            lo = torch.randint(0, n - 16, (b, t), generator=gen)
            band = (lo, lo + torch.randint(0, 17, (b, t), generator=gen))
        got = kernels.attend(q, keys, values, limit, d**-0.5, splits, band)
        sees = torch.arange(n)[None, None, :] < limit[:, :, None]
        if band is not None:
            j = torch.arange(n)[None, None, :]
            sees = sees | ((j >= band[0][:, :, None]) & (j < band[1][:, :, None]))
        sees = sees[:, None, None].expand(b, 1, g, t, n).reshape(b, 1, g * t, n)
        mask = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, float("-inf"))
        want = torch.nn.functional.scaled_dot_product_attention(
            q, keys[:b, :, :n], values[:b, :, :n], mask, scale=d**-0.5
        )
        torch.testing.assert_close(got, want, **_tol(dtype))
