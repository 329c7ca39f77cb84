"""Memory arithmetic: bytes of weights, KV cache and activations, and a device's free memory.

Pure functions of a model config and a dtype (the KV sizes and a device's free memory come from
:mod:`d3d.backends.sizes`), shared by the engine (the prefix cache's size) and ``d3d plan`` (:mod:`d3d.tools.plan`).

- KV cache: 2 (keys and values) x layers x KV heads x head dim x bytes per token; Qwen3-8B in
  bf16 holds 144 KiB a token, so the 256 MiB the prefix cache once had kept ~1,800 tokens. The
  prefix cache is therefore sized from the memory there is (:func:`prefix_cache_bytes`, a
  :class:`d3d.config.CacheBudget`).
- Activations of one decoder layer per row of a forward: the residual stream and its normed
  copy (2H) plus the MLP's gate, up and their product (3I), the largest set alive at once in a
  Llama/Qwen layer; layers run one after another, so this is a forward's working set, not
  multiplied by depth.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from d3d.backends.sizes import dtype_bytes, free_bytes, kv_bytes_per_token
from d3d.config import CacheBudget

log = logging.getLogger(__name__)


def activation_bytes_per_row(config, dtype: torch.dtype) -> int:
    """One forward row's working set inside a decoder layer (module docstring)."""
    return (2 * config.hidden_size + 3 * config.intermediate_size) * dtype_bytes(dtype)


def param_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each tensor counted once (a tied head once);
    works on the meta device, where nothing is allocated."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def prefix_cache_bytes(model: nn.Module, budget: CacheBudget) -> int:
    """The prefix cache's size for ``model`` under ``budget`` (free memory read now, on the
    model's device, so call it once the weights are loaded); at least 1 byte."""
    p = next(model.parameters())
    kv = kv_bytes_per_token(model.config, p.dtype)
    free = free_bytes(p.device) if budget.kind == "fraction" else 0
    size = max(budget.resolve(kv, free), 1)
    log.info("prefix cache: %.2f GiB (%d tokens at %d bytes a token)", size / 2**30, size // kv, kv)
    return size
