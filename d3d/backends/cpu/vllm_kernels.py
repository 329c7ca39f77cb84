"""The CPU backend's one door to vLLM's CPU kernels (vLLM is optional: without it, none).

Every kernel the CPU backend calls is reached here: the custom ops module (oneDNN matmul
handlers, RMSNorm, fused add + RMSNorm, rotary embedding, paged attention and its cache writes
and schedule) and the attention backend's variant for a dtype and head size. :data:`KERNELS`
names them; :func:`missing` says which the installed vLLM lacks, and
:func:`d3d.vllm.patches.missing` reports them beside the engine patches, so a vLLM upgrade that
drops one fails the tests instead of silently slowing the CPU path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# Functions of vllm._custom_ops the backend calls (oneDNN, lean forward, attention).
KERNELS = (
    "create_onednn_mm",
    "onednn_mm",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "cpu_attn_reshape_and_cache",
    "cpu_attn_get_scheduler_metadata",
    "cpu_attention_with_kv_cache",
)
TORCH_OPS = ("rms_norm", "rotary_embedding")  # torch.ops._C, the fused module forwards


def ops() -> Any:
    """vLLM's custom ops module (imported on first use)."""
    import vllm._custom_ops as custom_ops

    return custom_ops


def torch_ops() -> Any:
    """``torch.ops._C`` with vLLM's CPU kernels loaded (raises where they cannot be)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError("vLLM's CPU kernels need its CPU build")
    current_platform.import_kernels()
    return torch.ops._C


def supports_onednn() -> bool:
    """Whether this vLLM build has its oneDNN matmul handlers."""
    return bool(getattr(ops(), "_supports_onednn", False))


def available() -> bool:
    """Whether vLLM's CPU kernels can be loaded (its CPU build is installed)."""
    try:
        ops_c = torch_ops()
        return all(hasattr(ops_c, name) for name in TORCH_OPS)
    except Exception:  # any import failure means: no vLLM CPU kernels here
        return False


def attention_isa(dtype: torch.dtype, head_dim: int) -> str | None:
    """vLLM's CPU attention variant for this dtype and head dim (None: it has none)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

        if head_dim not in CPUAttentionBackend.get_supported_head_sizes():
            return None
        if dtype not in CPUAttentionBackend.supported_dtypes:
            return None
        return _get_attn_isa(dtype, 64, head_dim)
    except Exception as e:  # any failure to load vLLM's backend: no kernel
        log.info("vLLM's CPU attention is unavailable: %s", e)
        return None


def missing() -> list[str]:
    """The kernels the backend calls that the installed vLLM lacks (raises ImportError where
    vLLM is not installed at all)."""
    gaps = [
        f"vllm._custom_ops.{k}" for k in (*KERNELS, "_supports_onednn") if not hasattr(ops(), k)
    ]
    try:
        ops_c = torch_ops()
        gaps += [f"torch.ops._C.{k}" for k in TORCH_OPS if not hasattr(ops_c, k)]
    except Exception as exc:
        gaps.append(f"torch.ops._C ({exc})")
    try:
        from vllm.v1.attention.backends import cpu_attn

        gaps += [f"cpu_attn.{n}" for n in ("CPUAttentionBackend", "_get_attn_isa")
                 if not hasattr(cpu_attn, n)]  # fmt: skip
    except ImportError as exc:
        gaps.append(f"vllm.v1.attention.backends.cpu_attn ({exc})")
    return gaps
