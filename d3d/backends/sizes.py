"""Sizes a KV layout is built from: a model config's window, KV heads and head dim, the bytes a
token's keys and values take, and how much memory a device has free.

Pure functions of a config and a dtype (plus :func:`free_bytes`, which asks the device). The
backends size their KV with them; :mod:`d3d.model.memory` builds the weight and activation
arithmetic of ``d3d plan`` on top of them.
"""

from __future__ import annotations

import os

import torch


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def head_dim(config) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


UNSTATED_WINDOW = 8192  # positions assumed where a config states no window (readers, sweeps)


def window(config) -> int | None:
    """The positions a model attends (``max_position_embeddings``), the one place a model's
    window is read; None where its config does not state one."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def kv_heads(config) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def kv_token_bytes(layers: int, heads: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token adds to ``layers`` layers of ``heads`` KV heads."""
    return 2 * int(layers) * heads * dim * dtype_bytes(dtype)


def kv_bytes_per_token(config, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of keys and values one token adds to a cache of ``layers`` (default: all) layers."""
    n = config.num_hidden_layers if layers is None else layers
    return kv_token_bytes(n, kv_heads(config), head_dim(config), dtype)


def free_bytes(device: str | torch.device) -> int:
    """Free memory on ``device``: CUDA's own count, else the host's available memory."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
