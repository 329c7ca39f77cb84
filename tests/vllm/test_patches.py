"""vLLM's internals are touched in one module (d3d/vllm/patches.py) behind one version gate, and
what each touch needs is checked against the installed vLLM: a gap fails here, naming it, instead
of leaving a fast path silently off after an upgrade."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from d3d.backends.cpu import vllm_kernels  # noqa: E402
from d3d.vllm import VLLM_VERSION, patches  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_pinned_vllm_has_everything_the_patches_and_kernels_need():
    gaps = patches.missing()
    assert not gaps, "vLLM lacks what D3D touches:\n" + "\n".join(gaps)
    assert patches.version() == VLLM_VERSION


@pytest.mark.parametrize(
    ("path", "attr"),
    [
        ("vllm.v1.engine.core:EngineCore", "post_step"),
        ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_prepare_inputs"),
        ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "take_draft_token_ids"),
    ],
)
def test_a_hidden_attribute_is_named(monkeypatch, path, attr):
    module, _, name = path.partition(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    monkeypatch.delattr(cls, attr)
    gaps = patches.missing()
    assert any(f"{name}.{attr}: missing" in g for g in gaps), gaps
    if attr == "post_step":  # and nothing is patched where something is missing
        assert patches.wrap_post_step(lambda core, executed: False) is False


def test_an_instance_attribute_read_from_init_is_checked():
    needs = (("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "self.no_such_field", "a read"),)
    assert patches.missing_touches(needs)[-1].startswith("vllm.v1.worker.gpu_model_runner:")


def test_another_version_leaves_every_patch_off(monkeypatch):
    monkeypatch.setattr(patches, "VLLM_VERSION", "0.0.1")
    assert "is not the pinned 0.0.1" in patches.missing_touches()[0]
    runner = type("FakeModelRunner", (), {"_prepare_inputs": lambda self, s: s})()
    assert patches.wrap_prepare_inputs(runner, lambda s: True) is False


def test_a_missing_cpu_kernel_is_named(monkeypatch):
    if not vllm_kernels.available():
        pytest.skip("not vLLM's CPU build")
    monkeypatch.setattr(vllm_kernels, "KERNELS", (*vllm_kernels.KERNELS, "no_such_kernel"))
    assert "CPU kernel vllm._custom_ops.no_such_kernel: missing" in " ".join(patches.missing())


def test_the_three_methods_are_patched_in_the_one_module_only():
    assign = re.compile(r"\.(post_step|_prepare_inputs|take_draft_token_ids)\s*=(?!=)")
    where = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("d3d", "app", "eval", "compression")
        for path in (ROOT / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if assign.search(line)
    ]
    assert where and all(w.startswith("d3d/vllm/patches.py:") for w in where), where
    private = re.compile(r"vllm\._custom_ops|_get_attn_isa|sys\._getframe")
    reads = [
        str(path.relative_to(ROOT))
        for folder in ("d3d", "app")
        for path in (ROOT / folder).rglob("*.py")
        if private.search(path.read_text())
    ]
    assert sorted(set(reads)) == ["d3d/backends/cpu/vllm_kernels.py", "d3d/vllm/patches.py"], reads
