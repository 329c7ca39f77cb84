"""Drafter checkpoints: what a folder stores, and how a drafter is rebuilt from one.

A checkpoint is ``drafter.json`` (the :class:`d3d.model.drafter.DrafterMeta` and the LM config) and
``drafter.safetensors`` (the drafter's own tensors). Tensors borrowed from the target are never
stored: its embeddings and LM head (``meta.shared_embeddings``), and for an adapter drafter
(``meta.adapter``) its frozen layers too — such a checkpoint holds only the adapters, the mask
embedding and the draft-vocabulary ids (a few MB at any depth). A drafter initialised from
another pretrained model (``meta.init``) stores its own embeddings and head when trained in
full; with adapters, its frozen rest is read again from ``meta.init``. Loading recognises the
kind from the JSON alone, so callers (``d3d.engine.build_drafter``) never need to know which it
is, and reads the stored tensors straight to the drafter's device.

A checkpoint may store its weight matrices in 8 bits (``save_drafter(..., int8=True)``): each
matrix as int8 with one scale per output row (symmetric, the largest magnitude of a row maps to
127), the scales beside it under ``<name>`` + :data:`INT8_SCALE`. Loading recognises them by
that suffix and rebuilds the matrix in the target's dtype, so nothing else changes. It halves a
full-layer drafter's file (the shipped 7-layer one: 49.6 MB in float16), at a rounding of at
most half a step of each row's scale; the drafter only proposes, so the output stays the
target's whatever its weights.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from d3d.model.adapters import AdapterConfig
from d3d.model.meta import (
    META_FILE,
    SHARED_KEYS,
    WEIGHTS_FILE,
    DrafterError,
    DrafterMeta,
    layer_stack,
    vocab_rows,
)
from d3d.model.skeleton import finish, meta_lm

INT8_SCALE = ".int8_scale"  # a stored int8 matrix's per-row scales: [rows, 1] float32
INT8_MIN_SIZE = 1 << 16  # smaller tensors (norms, the mask embedding) stay as they are

# The drafter class is handed in (``cls``): this module describes checkpoints without
# importing the drafter, which imports this module to save and load itself.
D3DDrafter = nn.Module


def save_drafter(
    drafter: D3DDrafter,
    path: str | Path,
    dtype: torch.dtype | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    int8: bool = False,
) -> Path:
    """Write the checkpoint folder (borrowed tensors left out; floating tensors stored in
    ``dtype`` when given — loading casts them back to the target's dtype). ``tensors``: the
    drafter's state dict as whole tensors when its own are shards (a sharded training run).
    ``int8``: weight matrices in 8 bits with per-row scales (module docstring)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    for k, v in (drafter.state_dict() if tensors is None else tensors).items():
        if drafter.meta.shared_embeddings and k.startswith(SHARED_KEYS):
            continue  # the target's tensors: never copied, never stored
        if drafter.adapters is not None and k.startswith("lm."):
            continue  # frozen target layers: rebuilt from the target on load
        # A tied LM head aliases the input embeddings: store the matrix once; loading
        # re-ties it from the config (tie_word_embeddings).
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            t = v.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            state[k] = t.contiguous().cpu()
    if int8:
        state = quantize_int8(state)
    save_file(state, str(out / WEIGHTS_FILE))
    meta = asdict(drafter.meta)
    meta["layers"] = list(drafter.meta.layers)
    doc = {"meta": meta, "lm_config": drafter.lm.config.to_dict()}
    (out / META_FILE).write_text(json.dumps(doc, indent=2))
    return out


def load_drafter(
    cls: type[D3DDrafter],
    path: str | Path,
    target: PreTrainedModel,
    device: str | torch.device | None = None,
) -> D3DDrafter:
    """Rebuild a drafter of class ``cls`` from a checkpoint folder and its ``target``."""
    src = Path(path)
    if not (src / META_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
        raise DrafterError(
            f"{src} is not a drafter checkpoint (needs {META_FILE} and {WEIGHTS_FILE})"
        )
    try:
        doc = json.loads((src / META_FILE).read_text())
        meta_d = doc["meta"]
        meta = DrafterMeta(**{**meta_d, "layers": tuple(meta_d["layers"])})
        cfg_d = dict(doc["lm_config"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DrafterError(f"{src / META_FILE} is unreadable: {exc}") from exc
    if meta.vocab_size and meta.vocab_size != vocab_rows(target):
        raise DrafterError(
            f"drafter vocabulary ({meta.vocab_size}) does not match the target's ({vocab_rows(target)})"
        )
    if meta.adapter is not None:
        return _load_adapter(cls, src, meta, target, device)
    cfg = AutoConfig.for_model(cfg_d.pop("model_type"), **cfg_d)
    # A meta skeleton (no random embeddings or head to drop), the target's shared modules, then
    # the stored tensors by assignment, each cast once to the target's dtype on the drafter's
    # device.
    dev = device or target.device
    lm = meta_lm(cfg, target.dtype, target.config._attn_implementation)
    if meta.shared_embeddings:
        lm.set_input_embeddings(target.get_input_embeddings())
        lm.set_output_embeddings(target.get_output_embeddings())
    drafter = cls(lm, meta)
    stored = dequantize_int8(load_file(str(src / WEIGHTS_FILE), device=str(torch.device(dev))))
    state = {
        k: v.to(dtype=target.dtype if v.is_floating_point() else v.dtype) for k, v in stored.items()
    }
    missing, unexpected = drafter.load_state_dict(state, strict=False, assign=True)
    tied = getattr(cfg, "tie_word_embeddings", False) and not meta.shared_embeddings
    if tied:
        lm.tie_weights()
    missing = [
        k
        for k in missing
        if not (meta.shared_embeddings and k.startswith(SHARED_KEYS))
        and not (tied and k == "lm.lm_head.weight")
    ]
    _check_fit(src, missing, unexpected)
    finish(lm, dev, rotary=target.model.rotary_emb if meta.shared_embeddings else None)
    drafter.place(dev)  # already in the target's dtype
    drafter.eval()
    return drafter


def _load_adapter(
    cls: type[D3DDrafter], src: Path, meta: DrafterMeta, target: PreTrainedModel, device
) -> D3DDrafter:
    """An adapter checkpoint: the target's layers again (shared), or the ``meta.init`` model's,
    then the stored tensors."""
    adapter = AdapterConfig.from_dict(meta.adapter)
    if meta.init is not None:
        drafter = cls.from_pretrained(meta.init, target, device, adapter, meta.block_size)
        if len(drafter.meta.layers) != len(meta.layers):
            raise DrafterError(
                f"adapter checkpoint {src} was trained on a {len(meta.layers)}-layer "
                f"{meta.init}, which now has {len(drafter.meta.layers)} layers"
            )
    else:
        depth = len(layer_stack(target))
        if meta.target_layers and meta.target_layers != depth:
            raise DrafterError(
                f"adapter checkpoint {src} was trained on a {meta.target_layers}-layer target, "
                f"this one has {depth}"
            )
        drafter = cls.from_target(target, list(meta.layers), meta.block_size, meta.base,
                                  adapter=adapter)  # fmt: skip
    drafter.meta = dataclasses.replace(meta, draft_vocab=0)
    if meta.draft_vocab:
        drafter.set_draft_vocab(torch.arange(meta.draft_vocab))  # ids come with the state
    stored = dequantize_int8(load_file(str(src / WEIGHTS_FILE)))
    missing, unexpected = drafter.load_state_dict(stored, strict=False)
    _check_fit(src, [k for k in missing if not k.startswith("lm.")], unexpected)
    drafter.place(device or target.device, dtype=target.dtype)
    drafter.eval()
    return drafter


def quantize_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating matrices of at least :data:`INT8_MIN_SIZE` entries as int8 [rows, cols] and
    their per-row scales (module docstring); every other tensor as it is."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if not (v.is_floating_point() and v.dim() == 2 and v.numel() >= INT8_MIN_SIZE):
            out[k] = v
            continue
        w = v.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # [rows, 1]
        out[k] = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).contiguous()
        out[k + INT8_SCALE] = scale.contiguous()
    return out


def dequantize_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`quantize_int8`: int8 matrices with stored scales back to float32
    (their callers cast to the target's dtype); a state without scales is returned as it is."""
    scales = {k[: -len(INT8_SCALE)]: v for k, v in state.items() if k.endswith(INT8_SCALE)}
    if not scales:
        return state
    return {
        k: v.float() * scales[k] if k in scales else v
        for k, v in state.items()
        if not k.endswith(INT8_SCALE)
    }


def _check_fit(src: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise DrafterError(
            f"checkpoint {src} does not fit its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
