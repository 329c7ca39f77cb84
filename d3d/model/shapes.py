"""Model configs by name: the published shapes shipped in ``d3d/configs/`` (Qwen3-1.7B, -8B,
-32B), a ``config.json`` file, or a model folder holding one — shapes without weights, for
``d3d plan``, the GPU check and the replay instrument's random drafter shapes — and a model of
random weights built from one (:func:`random_model`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class ShapeError(ValueError):
    """A model config cannot be read; the message says why in one line."""


def load_config(spec: str) -> tuple[str, PretrainedConfig]:
    """(its name, the config) of a shipped name, a ``config.json`` file or a model folder."""
    path = CONFIGS / f"{spec}.json" if (CONFIGS / f"{spec}.json").is_file() else Path(spec)
    path = path.expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise ShapeError(f"no model config at {spec!r}: give a config.json, a folder or {shipped}")
    try:
        d = json.loads(path.read_text())
        name = path.parent.name if path.name == "config.json" else path.stem
        return name, AutoConfig.for_model(d.pop("model_type"), **d)
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        raise ShapeError(f"{path} is not a model config: {exc}") from exc


def random_model(
    cfg: PretrainedConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    layers: int | None = None,
) -> PreTrainedModel:
    """A causal LM of ``cfg`` (its first ``layers`` decoder layers, where given) with random
    weights, made directly on ``device`` in ``dtype``, for inference (sdpa attention)."""
    cfg = copy.deepcopy(cfg)
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = list(cfg.layer_types)[:layers]
        if getattr(cfg, "max_window_layers", None) is not None:
            cfg.max_window_layers = min(cfg.max_window_layers, layers)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)
