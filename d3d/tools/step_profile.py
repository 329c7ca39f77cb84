"""Where a 1-row decode step's time goes, kernel by kernel: the GPU check's ``profile`` stage.

A step against its bandwidth floor is one number; what to change next needs the parts. This
runs the cuda backend's 1-row plain step (after a cached context) under ``torch.profiler``,
eagerly and replayed from its CUDA graph, and sums the device time of the kernels it launched,
per step, by kind:

- ``matmul``: the projections' and LM head's products (cuBLAS / CUTLASS GEMM and GEMV kernels);
- ``attention``: the SDPA kernel(s);
- ``triton``: the step's own kernels (:mod:`d3d.backends.cuda.kernels`);
- ``other``: every other kernel (copies, norms and elementwise chains left in torch, the mask).

The sum of kernel time against the step's wall time says how much of the step the device is
busy: the rest is launch gaps (eager) or the graph's scheduling. The ten kernels with the most
time are listed with their counts a step. On a CPU (``--tiny``) the same runs with the CPU's
operators in place of kernels, so the code is exercised; its figures are not a GPU's.
"""

from __future__ import annotations

import re

import torch
from torch.profiler import ProfilerActivity, profile

from d3d.backends.clock import Clock
from d3d.backends.cuda import CudaTarget
from d3d.backends.cuda.kv import MIN_CAPACITY, StaticKV
from d3d.tools.gpu_stages import BLOCK, row_after

KINDS = (
    ("triton", re.compile(r"_add_norm|_qk_in|_silu_mul")),
    ("attention", re.compile(r"fmha|flash|attention|attn|efficient", re.I)),
    ("matmul", re.compile(r"gemm|gemv|cutlass|xmma|cublas|sm\d+_|matmul|addmm|aten::mm|linear", re.I)),
)  # fmt: skip


def kind_of(name: str) -> str:
    """The kind a kernel (or, on a CPU, an operator) belongs to (module docstring)."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


@torch.inference_mode()
def step_profile(model, context: int, steps: int = 5) -> dict:
    """The 1-row step's kernels, eager and (on a GPU) replayed, per step (module docstring)."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    clock = Clock([device])  # reads the time after the device's queued work
    out: dict = {"context": context, "steps": steps}
    for name, graphs in (("eager", False), ("graphs", True)):
        if graphs and not cuda:
            continue
        kv = StaticKV.shaped(model, max(context + 2 * BLOCK, MIN_CAPACITY), 1)
        target = CudaTarget(model, kv, block=BLOCK, graphs=graphs)
        row = row_after(target, context)
        for _ in range(3):  # warm-up; the graph captured
            target.forward([row], [[1]])
        clock.sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t0 = clock.now()
            for _ in range(steps):
                target.forward([row], [[1]])
            wall = (clock.now() - t0) / steps
        out[name] = _summary(prof.key_averages(), steps, wall, cuda)
        target.kv.close(row)
        del target, kv
    return out


def _summary(events, steps: int, wall_s: float, cuda: bool) -> dict:
    """Per step: kernels launched, their device time by kind, the top ten, against the wall."""
    rows = []
    for e in events:
        if cuda:
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        else:
            if not e.key.startswith("aten::"):
                continue
            us = float(e.self_cpu_time_total)
        rows.append((e.key, e.count / steps, us / steps))
    by_kind: dict[str, float] = {}
    for key, _, us in rows:
        by_kind[kind_of(key)] = by_kind.get(kind_of(key), 0.0) + us
    busy = sum(us for _, _, us in rows)
    top = sorted(rows, key=lambda r: -r[2])[:10]
    return {
        "wall_us": round(wall_s * 1e6, 1),
        "kernel_us": round(busy, 1),
        "busy": round(busy / (wall_s * 1e6), 3) if wall_s > 0 else None,
        "launches": round(sum(n for _, n, _ in rows), 1),
        "by_kind_us": {k: round(v, 1) for k, v in sorted(by_kind.items())},
        "top": [{"name": k[:120], "per_step": round(n, 2), "us": round(us, 1)} for k, n, us in top],
    }
