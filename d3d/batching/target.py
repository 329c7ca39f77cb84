"""One target forward over many rows, each at its own length.

:class:`BatchTarget` owns the target model and a :class:`RowCache`. A forward takes a run of
slots and one list of new token ids per row; rows shorter than the longest are padded by
repeating their last id (the padded positions are written past the row's length, never
committed, and so never seen). Position ids and the 4D mask come from the cache, so every row
computes exactly what it would alone, up to floating-point summation order.

Letters: n rows in the forward, T new tokens (the longest row's), V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from d3d.batching.cache import RowCache
from d3d.hf import with_cache
from d3d.masks import to_model_mask


class BatchTarget:
    """The target model behind a per-row cache (see the module docstring)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = RowCache.for_model(model)
        self.attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        self.dtype = next(model.parameters()).dtype
        self.last_seconds = 0.0

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @torch.inference_mode()
    def forward(
        self, start: int, ids: Sequence[Sequence[int]], keep: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Append ``ids[b]`` to slot ``start + b``; logits [n, T, V] (or [n, len(keep), V]).

        ``keep`` selects which query positions get logits (the same indices for every row);
        None keeps all. Nothing is committed: call :meth:`RowCache.commit` per row after.
        """
        t0 = time.perf_counter()
        width = max(len(row) for row in ids)
        x = torch.tensor(
            [list(row) + [row[-1]] * (width - len(row)) for row in ids], device=self.device
        )  # [n, T]
        pos, mask = self.cache.begin(start, start + len(ids), width)
        keep_arg: int | torch.Tensor = 0
        if keep is not None:
            keep_arg = torch.tensor(list(keep), device=self.device)
        out = self.model(
            input_ids=x,
            position_ids=pos,
            attention_mask=to_model_mask(mask, self.attn, self.dtype),
            logits_to_keep=keep_arg,
            **with_cache(self.model, self.cache),
        )
        self.last_seconds = time.perf_counter() - t0
        return out.logits
