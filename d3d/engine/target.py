"""One target forward over many rows, each at its own length, timed on the engine's clock.

:class:`BatchTarget` owns the target model and its :class:`~d3d.engine.kv.RowKV`. A forward
takes a list of rows and one list of new token ids per row (a decoding row's anchor and drafts,
a prompt's next chunk) and runs them as one flat sequence (:mod:`d3d.model.ragged`): the
weights are read once for the step, no row is padded, and attention stays within each row, so
every row computes what it would alone, up to floating-point summation order. Logits are
computed only where asked (``keep``: per row, which of its positions).

Where the model has a lean forward (:mod:`d3d.model.lean`: a Llama-family model on a CPU with
vLLM's kernels), that runs instead of the model's own, once a sample of two rows over two steps
gave the same logits both ways (to :data:`d3d.model.fused.TOLERANCE`); otherwise it is dropped and the model's own
forward runs.

Letters: n rows, N new tokens in all, T_r one row's, V vocab.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from d3d.decoding.clock import WALL, Clock
from d3d.engine.kv import KvRow, RowKV
from d3d.model import fused, lean
from d3d.model.hf import with_cache
from d3d.model.ragged import KWARG

log = logging.getLogger(__name__)


class BatchTarget:
    """The target model and its per-row KV (see the module docstring)."""

    def __init__(
        self, model: PreTrainedModel, max_kv_tokens: int, clock: Clock = WALL, lean: bool = True
    ):
        """``lean``: run the model's lean forward where it has one that passes its sample."""
        self.model = model
        self.kv = RowKV.for_model(model, max_kv_tokens)
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
        self.lean = _checked_lean(model) if lean else None

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
        wanted = [
            list(range(w)) if keep is None or keep[b] is None else list(keep[b])
            for b, w in enumerate(widths)
        ]
        flat = [starts[b] + i for b, w in enumerate(wanted) for i in w]
        kept = torch.tensor(flat or [0], device=self.device)
        if self.lean is not None:
            logits = self.lean(x[0], pos[0], self.kv, ragged, kept)[: len(flat)]
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


def _checked_lean(model: PreTrainedModel) -> lean.LeanDecoder | None:
    """``model``'s lean forward once a sample agrees with the model's own (module docstring)."""
    dec = lean.of(model)
    if dec is None or dec.checked:
        return dec
    if _lean_agrees(model, dec):
        dec.checked = True
        return dec
    log.warning("the lean forward disagrees with %s's own; it runs its own", type(model).__name__)
    lean.detach(model)
    return None


def _lean_agrees(model: PreTrainedModel, dec: lean.LeanDecoder) -> bool:
    """Two rows over two steps (a prompt's chunk, then a few tokens), each step's logits from
    the model's own forward and from ``dec`` over the same KV."""
    t = BatchTarget(model, 64, lean=False)
    rows = [t.kv.open(16), t.kv.open(16)]
    gen = torch.Generator().manual_seed(0)
    for widths in ((5, 3), (2, 1)):
        ids = [torch.randint(t.vocab_size, (w,), generator=gen).tolist() for w in widths]
        own = torch.cat(t.forward(rows, ids))
        if not fused.agree(lambda i=ids: _lean_logits(t, dec, rows, i), lambda o=own: o):
            return False
        for row, w in zip(rows, widths, strict=True):
            t.kv.commit(row, w)
    return True


def _lean_logits(t: BatchTarget, dec: lean.LeanDecoder, rows, ids) -> torch.Tensor:
    """One forward of ``t`` through ``dec`` (``t`` otherwise runs the model's own)."""
    t.lean = dec
    try:
        return torch.cat(t.forward(rows, ids))
    finally:
        t.lean = None
