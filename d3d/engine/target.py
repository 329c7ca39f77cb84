"""One target forward over many rows, each at its own length, timed on the engine's clock.

:class:`BatchTarget` owns the target model and its :class:`~d3d.engine.kv.PagedKV`. A forward
takes a list of rows and one list of new token ids per row; rows shorter than the longest are
padded (the padding's keys go to the pool's scratch slot and are never seen). Position ids and
the 4D mask come from the pool, so every row computes what it would alone, up to floating-point
summation order.

Letters: n rows in the forward, T new tokens (the longest row's), V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from d3d.clock import WALL, Clock
from d3d.engine.kv import KvRow, PagedKV
from d3d.hf import with_cache
from d3d.masks import to_model_mask


class BatchTarget:
    """The target model behind a paged KV pool (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, max_kv_tokens: int, clock: Clock = WALL):
        self.model = model
        self.kv = PagedKV.for_model(model, max_kv_tokens)
        self.attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        self.dtype = next(model.parameters()).dtype
        self.clock = clock
        self.last_seconds = 0.0

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def forward(
        self,
        rows: Sequence[KvRow],
        ids: Sequence[Sequence[int]],
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``ids[b]`` to ``rows[b]``; logits [n, T, V] (or [n, len(keep), V]).

        ``keep`` selects which query positions get logits (the same indices for every row);
        None keeps all. Nothing is committed: call :meth:`PagedKV.commit` per row after.
        """
        t0 = self.clock.now()
        width = max(len(r) for r in ids)
        x = torch.tensor(
            [list(r) + [r[-1]] * (width - len(r)) for r in ids], device=self.device
        )  # [n, T]
        pos, mask = self.kv.begin(rows, [len(r) for r in ids])
        keep_arg: int | torch.Tensor = 0
        if keep is not None:
            keep_arg = torch.tensor(list(keep), device=self.device)
        out = self.model(
            input_ids=x,
            position_ids=pos,
            attention_mask=to_model_mask(mask, self.attn, self.dtype),
            logits_to_keep=keep_arg,
            **with_cache(self.model, self.kv),
        )
        logits = out.logits
        self.last_seconds = self.clock.now() - t0
        return logits
