"""One target forward over many rows, each at its own length, timed on the engine's clock.

:class:`BatchTarget` owns the target model and its :class:`~d3d.backends.kv.RowKV`. A forward
takes a list of rows and one list of new token ids per row (a decoding row's anchor and drafts,
a prompt's next chunk) and runs them as one flat sequence (:mod:`d3d.backends.ragged`): the
weights are read once for the step, no row is padded, and attention stays within each row, so
every row computes what it would alone, up to floating-point summation order. Logits are
computed only where asked (``keep``: per row, which of its positions).

A backend may hand it a forward of its own (``fast``: the CPU backend's lean forward in vLLM's
kernels, :mod:`d3d.backends.cpu.lean`) with the same contract; the model's own Hugging Face
forward runs otherwise. Backends check a fast forward against the model's own on a sample at
load (:mod:`d3d.backends.check`) before they hand it over.

Letters: n rows, N new tokens in all, T_r one row's, M kept positions, V vocab.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from d3d.backends.clock import WALL, Clock
from d3d.backends.hf import with_cache
from d3d.backends.kv import KvRow, RowKV
from d3d.backends.ragged import KWARG, Ragged

log = logging.getLogger(__name__)

FastForward = Callable[[torch.Tensor, torch.Tensor, RowKV, Ragged, torch.Tensor], torch.Tensor]
"""``fast(ids [N], positions [N], kv, ragged, keep [M]) -> logits [M, V]``: a step's forward that
writes the new keys through ``kv.update`` and attends through ``ragged``."""


class BatchTarget:
    """The target model and its per-row KV (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        kv: RowKV,
        clock: Clock = WALL,
        fast: FastForward | None = None,
    ):
        self.model = model
        self.kv = kv
        attn = getattr(model.config, "_attn_implementation", None)
        if attn != "sdpa":  # the ragged forward wraps sdpa (every decoder here supports it)
            log.warning("the target's attention is %r; the engine runs it with sdpa", attn)
            model.config._attn_implementation = "sdpa"
        self.dtype = next(model.parameters()).dtype
        # A 4D mask passes through Hugging Face's mask building untouched; the attention is
        # ragged_attention's, which never reads it.
        self._mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.clock = clock
        self.last_seconds = 0.0
        self.last_logits: torch.Tensor | None = None  # the last forward's, all rows': [M, V]
        self.fast = fast

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def capture(self) -> int:
        """Ready every step shape serving will meet, before it meets them (a backend whose
        steps replay captured graphs); how many were readied. Here: none to ready."""
        return 0

    @torch.inference_mode()
    def forward(
        self,
        rows: Sequence[KvRow],
        ids: Sequence[Sequence[int]],
        keep: Sequence[Sequence[int] | None] | None = None,
    ) -> list[torch.Tensor]:
        """Append ``ids[b]`` to ``rows[b]``; row b's logits [T_b, V] (or [len(keep[b]), V]).

        ``keep[b]``: the positions of row b's new tokens that need logits (None: all of them);
        ``keep`` None: all positions of every row. Nothing is committed: call
        :meth:`RowKV.commit` per row after.
        """
        t0 = self.clock.now()
        widths = [len(r) for r in ids]
        x = torch.tensor([[t for r in ids for t in r]], device=self.device)  # [1, N]
        pos, ragged = self.kv.begin(rows, widths)
        starts = [0, *itertools.accumulate(widths)][:-1]
        wanted = kept_positions(ids, keep)
        flat = [starts[b] + i for b, w in enumerate(wanted) for i in w]
        kept = torch.tensor(flat or [0], device=self.device)
        if self.fast is not None:
            logits = self.fast(x[0], pos[0], self.kv, ragged, kept)[: len(flat)]
        else:
            out = self.model(
                input_ids=x,
                position_ids=pos,
                attention_mask=self._mask,
                logits_to_keep=kept,
                **with_cache(self.model, self.kv),
                **{KWARG: ragged},
            )
            logits = out.logits[0, : len(flat)]  # [sum of kept, V]
        self.last_logits = logits
        self.last_seconds = self.clock.now() - t0
        return list(logits.split([len(w) for w in wanted]))


def kept_positions(
    ids: Sequence[Sequence[int]], keep: Sequence[Sequence[int] | None] | None
) -> list[list[int]]:
    """Per row, the positions of its new tokens that need logits (``keep``'s, or all of them)."""
    return [
        list(range(len(r))) if keep is None or keep[b] is None else list(keep[b])
        for b, r in enumerate(ids)
    ]
