"""A Llama-family decoder's forward in vLLM's CPU kernels, without Hugging Face's layer code.

Profiled here, a decode step through the Hugging Face model spent a share of its time outside
any kernel (measured: docs/results.md, "Figures from the code's docstrings"): per layer, the
modules' calls, their hooks and keyword plumbing, the attention-interface dispatch, a position
table rebuilt every forward, and seven linear maps where four do (q / k / v read the same input,
so do gate / up). vLLM avoids both by running its own model code, compiled. :class:`LeanDecoder`
is the same forward written out once, over the same weights:

    h = embed(ids)
    for each layer:   x, r = add_norm(h, r)           one pass: r += h; x = rmsnorm(r)
                      q, k, v = split(x @ Wqkv)       one packed map for all three
                      (Qwen3: per-head rmsnorm of q, k)
                      rotate q, k in place             a cos | sin table built once
                      write k, v; attend               the engine's KV and ragged attention
                      h = o @ Wo;  x, r = add_norm(h, r)
                      h = (silu(g) * u) @ Wdown        g | u from one packed map
    logits = head(norm(h + r)[keep])                  only the kept positions

It takes less time than the Hugging Face forward with the same fused kernels, for decode steps,
verifies and prompts alike (measured: docs/results.md, "Figures from the code's docstrings"),
and its logits equal that forward's (the fused maps compute each output column as the separate
ones do).

:func:`attach` builds one for a model where vLLM's CPU build is installed and every layer has
the expected form (checked by structure here; the CPU backend also checks a sample of logits
against the reference before using it: :mod:`d3d.backends.cpu`). It is kept
beside the model, not on it, so a deep copy of the model carries none. The packed maps are
vLLM's oneDNN handlers, which own their packed weights (the model's modules keep theirs for
every other caller: the drafter's shared layers, autograd, another device), called through
:mod:`d3d.backends.cpu.onednn` (a primitive for each thread budget).

Letters: N new tokens of the forward, M kept positions, H hidden, Hq / Hkv heads, D head dim,
I the MLP's inner width, V vocab.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from d3d.backends.cpu import fused, onednn, vllm_kernels
from d3d.backends.ragged import ragged_attention

log = logging.getLogger(__name__)

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, LeanDecoder] = weakref.WeakKeyDictionary()
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that do not depend on length
TABLE_ROWS = 4096  # the rotary table's first size; it doubles when a position needs it


def of(model: nn.Module) -> LeanDecoder | None:
    """``model``'s lean forward, if :func:`attach` built one."""
    return _ATTACHED.get(model)


def attach(model: nn.Module) -> int:
    """Build ``model``'s lean forward where it fits (module docstring); 1 if built, else 0."""
    if model in _ATTACHED:
        return 1
    why = _unfit(model)
    if why:
        log.info("no lean forward for %s: %s", type(model).__name__, why)
        return 0
    try:
        with torch.no_grad():
            _ATTACHED[model] = LeanDecoder(model)
    except (RuntimeError, AttributeError, ValueError) as e:  # a kernel refused a weight
        log.warning("no lean forward for %s: %s", type(model).__name__, e)
        return 0
    return 1


def detach(model: nn.Module) -> None:
    """Forget ``model``'s lean forward (its sample disagreed, or it is not wanted)."""
    _ATTACHED.pop(model, None)


class _Layer:
    """One decoder layer's weights as the lean forward reads them."""

    def __init__(self, layer: nn.Module):
        a, mlp = layer.self_attn, layer.mlp
        proj = (a.q_proj, a.k_proj, a.v_proj)
        bias = None
        if proj[0].bias is not None:
            bias = torch.cat([p.bias.detach() for p in proj])
        self.attn = a  # the module the ragged attention reads its layer index and kernel from
        self.qkv = onednn.handler(torch.cat([p.weight.detach() for p in proj]).t())
        self.qkv_bias = bias
        self.o = onednn.handler(a.o_proj.weight.detach().t())
        gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])
        self.gate_up = onednn.handler(gate_up.t())
        self.down = onednn.handler(mlp.down_proj.weight.detach().t())
        self.inner = mlp.gate_proj.weight.shape[0]
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.q_norm = None if qn is None else (qn.weight.detach(), qn.variance_epsilon)
        self.k_norm = None if kn is None else (kn.weight.detach(), kn.variance_epsilon)


class LeanDecoder:
    """The forward of a Llama-family causal LM over the engine's ragged rows (module docstring)."""

    def __init__(self, model: nn.Module):
        self.ops = vllm_kernels.ops()
        inner = model.model
        cfg = model.config
        attn = inner.layers[0].self_attn
        self.hq, self.hkv = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads or cfg.num_attention_heads,
        )
        self.d = attn.head_dim
        self.scaling = attn.scaling
        self.eps = inner.norm.variance_epsilon
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.embed = inner.embed_tokens.weight.detach()
        self.head = model.get_output_embeddings()
        self.rotary = inner.rotary_emb
        self.table = self._table(TABLE_ROWS)

    def _table(self, rows: int) -> torch.Tensor:
        """The rotary kernel's table [rows, D]: cos | sin halves at positions 0 .. rows-1."""
        x = torch.zeros(1, 1, dtype=self.embed.dtype)
        return fused.rope_table(*self.rotary(x, torch.arange(rows)[None]))

    @torch.inference_mode()
    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: Any, rows: Any, keep: torch.Tensor
    ) -> torch.Tensor:
        """ids, positions [N]; ``cache`` the engine's KV (its ``update`` writes the new keys),
        ``rows`` its ragged rows; keep [M] positions of the N that need logits -> [M, V]."""
        ops, n = self.ops, ids.shape[0]
        hq, hkv, d = self.hq, self.hkv, self.d
        need = int(positions.max()) + 1
        if need > self.table.shape[0]:
            self.table = self._table(max(need, 2 * self.table.shape[0]))
        h = F.embedding(ids, self.embed)  # [N, H]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual, h = h, torch.empty_like(h)
                ops.rms_norm(h, residual, layer.norm_in, self.eps)
            else:  # residual += h; h = norm(residual), in place
                ops.fused_add_rms_norm(h, residual, layer.norm_in, self.eps)
            qkv = onednn.mm(layer.qkv, h, layer.qkv_bias)  # [N, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            if layer.q_norm is not None:
                q = _head_norm(ops, q, n * hq, d, *layer.q_norm)
            if layer.k_norm is not None:
                k = _head_norm(ops, k, n * hkv, d, *layer.k_norm)
            ops.rotary_embedding(positions, q, k, d, self.table, True)
            k4 = k.view(n, hkv, d).transpose(0, 1)[None]  # [1, Hkv, N, D], a view
            v4 = v.view(n, hkv, d).transpose(0, 1)[None]
            cache.update(k4, v4, i)
            q4 = q.view(n, hq, d).transpose(0, 1)[None]
            o = ragged_attention(layer.attn, q4, k4, v4, rows, self.scaling)  # [1, N, Hq, D]
            h = onednn.mm(layer.o, o.view(n, hq * d), None)
            ops.fused_add_rms_norm(h, residual, layer.norm_post, self.eps)
            gate_up = onednn.mm(layer.gate_up, h, None)  # [N, 2 I]
            act = F.silu(gate_up[:, : layer.inner])
            act.mul_(gate_up[:, layer.inner :])
            h = onednn.mm(layer.down, act, None)
        # Only the kept positions go on: the norm is row by row, so this is the same numbers.
        h, residual = h.index_select(0, keep), residual.index_select(0, keep)
        ops.fused_add_rms_norm(h, residual, self.norm, self.eps)
        return self.head(h)  # [M, V]


def _head_norm(ops: Any, x: torch.Tensor, rows: int, d: int, w: torch.Tensor, eps: float):
    """Qwen3's RMSNorm over each head of x [N, heads * D] -> a new [N, heads * D]."""
    out = torch.empty(rows, d, dtype=x.dtype)
    ops.rms_norm(out, x.contiguous().view(rows, d), w, eps)
    return out.view(x.shape)


def _unfit(model: nn.Module) -> str:
    """Why ``model`` cannot run the lean forward ('' when it can)."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return "not a float32 model on the CPU"
    if not fused.available():
        return "vLLM's CPU kernels are not installed"
    inner = getattr(model, "model", None)
    cfg = getattr(model, "config", None)
    layers = getattr(inner, "layers", None)
    if cfg is None or not layers or not hasattr(inner, "embed_tokens"):
        return "not a Llama-family model"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    if not fused._is_rms_norm(getattr(inner, "norm", None)):
        return "its final norm is not an RMSNorm"
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope not in _STATIC_ROPE:
        return f"rotary embedding {rope!r}"
    for layer in layers:
        a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        need = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
        if a is None or not all(hasattr(a, x) for x in need):
            return "an attention module of another form"
        if a.o_proj.bias is not None:
            return "an output projection with a bias"
        if mlp is None or not all(hasattr(mlp, x) for x in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP of another form"
        if any(getattr(mlp, x).bias is not None for x in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP with biases"
        if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            return "an MLP activation other than SiLU"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [m for m in (getattr(a, "q_norm", None), getattr(a, "k_norm", None)) if m]
        if not all(fused._is_rms_norm(m) for m in norms):
            return "a norm other than RMSNorm"
        if getattr(layer, "attention_type", "full_attention") != "full_attention":
            return "a layer that is not full attention"
    return ""
