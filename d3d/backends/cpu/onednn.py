"""vLLM's packed oneDNN matmul, with a primitive for each thread budget.

vLLM's CPU build keeps a weight packed for oneDNN (``create_onednn_mm``) and caches one oneDNN
primitive per input shape (its rows and row stride), shared by every handler of the same weight
shape. A oneDNN primitive divides its work among the threads there were when it was built, and
keeps doing so. The engine runs the target on fewer threads while a drafter process drafts
(:meth:`d3d.engine.Engine.cpu_budget`), so a shape first seen then is built for fewer threads and
kept for every later forward at full strength: a primitive that load-time calibration built on
one thread made every later forward of that size run its matmuls on one core, in every mode
(measured: docs/results.md, "Figures from the code's docstrings").

:func:`mm` gives each thread count its own primitives. Under the count the handlers were made
with (the target's full budget, :func:`handler`), an input goes as it is; under another, it is
copied into rows with a longer stride (``PAD`` floats more per thread), which the cache keys
apart, so each budget builds and keeps its own. The copy is the input's size, small beside the
weights a matmul reads, and only the reduced budget pays it.
"""

from __future__ import annotations

from typing import Any

import torch

from d3d.backends.cpu import vllm_kernels

PAD = 16  # floats of row stride added per thread under a budget other than the handlers'

_made_with: int | None = None  # the thread count the first handler was made under


def ops() -> Any:
    """vLLM's custom ops module (imported on first use: vLLM is optional)."""
    return vllm_kernels.ops()


def handler(weight_t: torch.Tensor) -> Any:
    """vLLM's oneDNN matmul handler over ``weight_t`` [K, N] (raises where it refuses)."""
    global _made_with
    if _made_with is None:
        _made_with = torch.get_num_threads()
    return ops().create_onednn_mm(weight_t, 32)


def mm(h: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W + bias`` through handler ``h`` with a primitive built for the calling thread
    count (module docstring); x [..., K] -> [..., N]."""
    threads = torch.get_num_threads()
    if _made_with is not None and threads != _made_with:
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        wide = rows.new_empty(rows.shape[0], k + PAD * threads)
        wide[:, :k].copy_(rows)
        out = ops().onednn_mm(h, wide[:, :k], bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    return ops().onednn_mm(h, x, bias)
