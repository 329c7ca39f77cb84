"""The drafter a training run starts from.

Design:

- ``self:N`` / ``self:i,j,k``: copies of some of the target's own layers, trained in full; the
  target's embeddings and LM head are shared and frozen. ``lora:N[:RANK]``: the target's first
  N layers, frozen and shared in memory, plus gated adapters (:mod:`d3d.model.adapters`).
- ``init:MODEL`` (``d3d train --init MODEL``; ``hf:MODEL`` is the older spelling): a whole
  pretrained causal LM that shares the target's tokenizer — an HF id or a folder, any width and
  depth (Qwen3-1.7B for a Qwen3-8B target). A separate model cannot share the target's
  embeddings when its width differs, so it keeps its own (frozen, like the target's would be);
  its layers, final norm and mask embedding train in full, or with ``adapter_rank`` > 0 only
  gated adapters and the mask embedding do. The checkpoint records the model in ``meta.init``.
- Anything else is a checkpoint folder to continue from (:func:`d3d.engine.build_drafter`).
- Fail fast: the vocabulary sizes must match (checked when the model loads) and, where the
  initial model ships a tokenizer, its vocabulary must be the target's token for token.
"""

from __future__ import annotations

import logging

import torch

from d3d.model.adapters import AdapterConfig
from d3d.model.drafter import D3DDrafter, DrafterError

log = logging.getLogger(__name__)

INIT_PREFIXES = ("init:", "hf:")


def init_spec(spec: str) -> str | None:
    """The model an ``init:`` / ``hf:`` spec names (None for other specs)."""
    for prefix in INIT_PREFIXES:
        if spec.startswith(prefix):
            return spec[len(prefix) :]
    return None


def check_tokenizer(model: str, tokenizer) -> None:
    """Fail unless ``model``'s tokenizer (when it has one) maps tokens to the target's ids."""
    if tokenizer is None:
        return
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        log.warning("%s ships no readable tokenizer (%s): assuming the target's", model, exc)
        return
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise DrafterError(
            f"{model}'s tokenizer differs from the target's: a drafter must share the target's "
            "tokenizer (same tokens, same ids)"
        )


def init_drafter(
    spec: str, target, device: str | torch.device | None = None, adapter_rank: int = 0
) -> D3DDrafter:
    """The drafter a run starts from (see the module docstring); ``target`` is a
    :class:`d3d.model.load.LoadedModel`."""
    from d3d.engine import build_drafter

    model = init_spec(spec)
    if model is not None:
        check_tokenizer(model, target.tokenizer)
        adapter = (
            AdapterConfig(rank=adapter_rank, alpha=2.0 * adapter_rank) if adapter_rank else None
        )
        return D3DDrafter.from_pretrained(model, target.model, device, adapter)
    if adapter_rank:
        raise ValueError(
            "--adapter-rank goes with --init MODEL (for the target's layers: lora:N:RANK)"
        )
    if spec.startswith("lora:"):
        parts = spec.split(":")
        try:
            n, rank = int(parts[1]), int(parts[2]) if len(parts) > 2 else 16
        except (IndexError, ValueError) as exc:
            raise ValueError(f"bad drafter spec {spec!r}: use lora:N or lora:N:RANK") from exc
        cfg = AdapterConfig(rank=rank, alpha=2.0 * rank)
        return D3DDrafter.from_target(target.model, n, base=target.spec, device=device,
                                      adapter=cfg)  # fmt: skip
    return build_drafter(spec, target, device)
