"""The cuda backend's Triton kernels, checked on the CPU by Triton's interpreter: the cases of
``interpreted_kernels.py`` in a pytest process of their own with ``TRITON_INTERPRET=1`` (Triton
reads it once, at its first import; this process must not run interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_equal_the_torch_forms_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "tests/engine/interpreted_kernels.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout


def _signature(kernel, dtype: str, constexprs: dict) -> dict:
    ints = {"cols", "inner", "qkv_stride", "s_slot", "s_head", "s_pos", "T", "n", "chunk",
            "splits"} - set(constexprs)  # fmt: skip
    out = {}
    for name in kernel.arg_names:
        if name in constexprs:
            out[name] = "constexpr"
        elif name in ints:
            out[name] = "i32"
        elif name in ("eps", "scale"):
            out[name] = "fp32"
        elif name in ("part_ptr", "ml_ptr", "o_ptr"):
            out[name] = "*fp32"  # the split attention's partial sums
        else:
            ints64 = ("slot_ptr", "at_ptr", "limit_ptr", "lo_ptr", "hi_ptr")
            out[name] = "*i64" if name in ints64 else f"*{dtype}"
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_kernels_compile_for_the_lent_gpus(dtype):
    """Triton's own compiler, ahead of time, to a cubin for sm_90 (the H100 and H200 the GPU
    check runs on), in the Qwen3-8B shape's constants: what the interpreter cannot show (the
    split attention's float32 form needs ~180 KB of shared memory at 64 queries: an sm_90 block
    may have 227 KB)."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from d3d.backends.cuda import kernels as k

    cases = [
        (k._add_norm, {"BLOCK": 4096}, 8),
        (k._silu_mul, {"BLOCK": 1024}, 4),
        (k._qk_in, {"G": 4, "HQ": 32, "HKV": 8, "D": 128, "NORM": True}, 1),
        (k._qk_in, {"G": 4, "HQ": 32, "HKV": 8, "D": 128, "NORM": False}, 1),
    ]
    prec = "ieee" if dtype == "fp32" else "tf32"
    # a plain step and a 16-token verify (G*T queries a key head), and the D3D-1.7B drafter's
    # packed step of a chain and 8 blocks (G 2, T 16 + 8*16: five tiles, with bands)
    for g, t, band in ((4, 1, False), (4, 16, False), (2, 144, True)):
        m = g * t
        tile = min(k.QUERY_TILE, max(16, m))
        pad = -(-m // tile) * tile
        split = {"HKV": 8, "M": m, "T": t, "BLOCK_M": tile, "BLOCK_N": 64, "D": 128,
                 "PREC": prec, "BAND": band}  # fmt: skip
        cases += [
            (k._attend_split, split, 4),
            (k._attend_join, {"M": m, "PAD": pad, "D": 128}, 1),
        ]
    for kernel, constexprs, warps in cases:
        src = ASTSource(fn=kernel, signature=_signature(kernel, dtype, constexprs),
                        constexprs=constexprs)  # fmt: skip
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})  # fmt: skip
        assert compiled.asm["cubin"], kernel
