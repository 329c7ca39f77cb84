"""vLLM's packed matmul through d3d.backends.cpu.onednn: the same map under every thread budget, and a
primitive for each (an input under another budget than the handlers' reaches the handler with a
row stride of its own, which vLLM's per-shape primitive cache keys apart)."""

import pytest
import torch

from d3d.backends.cpu import fused, onednn

pytestmark = pytest.mark.skipif(not fused.available(), reason="vLLM's CPU kernels not installed")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_map_is_the_same_under_every_budget(threads):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    bias = torch.randn(48, generator=gen)
    h = onednn.handler(w.t())
    x = torch.randn(2, 5, 40, generator=gen)
    full = onednn.mm(h, x, bias)
    torch.set_num_threads(onednn._made_with + 1)
    other = onednn.mm(h, x, bias)
    want = x @ w.t() + bias
    assert full.shape == other.shape == (2, 5, 48)
    torch.testing.assert_close(full, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(other, want, rtol=1e-4, atol=1e-4)


def test_each_budget_reaches_the_handler_with_its_own_row_stride(threads, monkeypatch):
    h = onednn.handler(torch.randn(24, 16).t())
    ops = onednn.ops()
    seen = []
    real = ops.onednn_mm
    monkeypatch.setattr(
        ops, "onednn_mm", lambda hh, a, b: seen.append(a.stride(0)) or real(hh, a, b)
    )
    x = torch.randn(16, 16)
    base = onednn._made_with  # the count of this process's first handler (maybe another test's)
    torch.set_num_threads(base)
    onednn.mm(h, x, None)
    for t in (base + 1, base + 2, base):
        torch.set_num_threads(t)
        onednn.mm(h, x, None)
    assert seen == [16, 16 + onednn.PAD * (base + 1), 16 + onednn.PAD * (base + 2), 16]
