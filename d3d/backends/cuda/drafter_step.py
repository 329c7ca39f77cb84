"""The drafter's packed step on the cuda backend: every row's chain and blocks in one forward
over the drafter's slot KV, written so that one call can be captured as a CUDA graph.

A step is B rows (slots), each adding T = W + nb*Bk tokens at storage positions
``length .. length + T - 1`` of its slot: first a *chain* of W committed tokens (the catch-up
of a miss, or the draft being verified: causal, kept as committed prefix), then nb *blocks*
``[anchor, MASK x K]`` (Bk = K + 1 slots each), never kept — the next step writes over them. A
block b carries its own *visible* length v_b: it sits at rotary positions ``v_b .. v_b + K``
(where it will be if its outcome happens) and sees the keys ``0 .. v_b - 1`` of its slot
(committed prefix plus the part of the chain its outcome accepts) and its own slots. So a
row's next block after a miss is one block with v = length + chain, and a row's branches are
nb blocks after its chain with v_b = committed + k_b and anchor r_b — the same forward.

What each query sees is built on the device from the step's lengths [B] and visible [B, nb],
as a bound and a band a query (each [B, T])::

    chain query at storage p:   key j <= p                          (causal: limit p + 1)
    block query (b, s):         j < v_b  or  j in block b's slots    (limit v_b, band: the block)

and, for a drafter with gated adapters, a block's anchor (s = 0) sees none of its mask slots
(ungated rows compute exactly the frozen layers, :mod:`d3d.model.adapters`). Chain pads (rows
with fewer than W chain tokens) and rows not in the step write keys only past their length and
are never attended by a real query. Everything but the decoder layers (the embeddings, the
mask embedding at the mask slots, positions and what each query sees) is computed here from
tensors at fixed addresses (:class:`PackedInputs`); the layers are
:meth:`StaticForward.layers_over`, the target step's own. The LM head runs outside, on the block
slots that predict drafts only.

Letters: B rows (slots), T tokens a row, W chain width, nb blocks a row, Bk block size, K = Bk-1
drafts, n keys attended, N = B*T, H hidden.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from d3d.backends.cuda.forward import StaticForward
from d3d.backends.cuda.kv import StaticKV


@dataclass(frozen=True)
class PackedInputs:
    """A packed step's inputs at fixed addresses: ids [B, T] (the chain, then each block's
    anchor at its first slot; mask slots' ids are ignored), lengths [B] (each slot's cached
    tokens), visible [B, nb] (each block's visible length)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    visible: torch.Tensor

    @classmethod
    def empty(cls, rows: int, width: int, blocks: int, device: torch.device) -> PackedInputs:
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(rows, width), z(rows), z(rows, blocks))

    def anchors(self, chain: int, block: int) -> torch.Tensor:
        """A view of the blocks' anchor ids [B, nb] (write it to place the anchors)."""
        nb = self.visible.shape[1]
        return self.ids.narrow(1, chain, nb * block).unflatten(1, (nb, block))[:, :, 0]


class PackedForward:
    """The packed drafter step over the slot KV ``kv`` (see the module docstring)."""

    def __init__(self, drafter, kv: StaticKV):
        self.core = StaticForward(drafter.lm, kv.keys, kv.values)
        self.block = drafter.block_size
        self.mask_embedding = drafter.mask_embedding
        self.adapters = drafter.adapters

    def chain_width(self, x: PackedInputs) -> int:
        return x.ids.shape[1] - x.visible.shape[1] * self.block

    @torch.inference_mode()
    def __call__(self, x: PackedInputs, n: int, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm [B*T, H]; writes the chain's and blocks' keys.
        ``slots`` [B]: the rows' slots (None: slots 0 .. B-1, the captured form)."""
        b, t = x.ids.shape
        nb, kb = x.visible.shape[1], self.block
        w = t - nb * kb
        dev = x.ids.device
        q = torch.arange(t, device=dev)  # [T]
        in_block = q >= w
        slot = (q - w).clamp_min(0) % kb  # [T]: 0 is a block's anchor
        gated = in_block & (slot > 0)  # the mask slots
        store = x.lengths[:, None] + q  # [B, T]: storage positions
        if nb:
            which = ((q - w).clamp_min(0) // kb).clamp_max(nb - 1)  # [T]: a query's block
            vis = x.visible[:, which]  # [B, T]
        else:
            vis = store
        pos = torch.where(in_block, vis + slot, store)  # [B, T]: rotary positions
        start = store - slot  # a block query's block's first storage position
        own = torch.full_like(slot, kb)
        if self.adapters is not None:  # anchors blind to their mask slots
            own = torch.where(slot == 0, 1, own)
        # a chain query sees the keys up to its own (causal); a block query its visible
        # prefix and the band of its own block's slots
        limit = torch.where(in_block, vis, store + 1)  # [B, T]
        lo = torch.where(in_block, start, 0)
        hi = torch.where(in_block, start + own, 0)
        h = self.core.inner.embed_tokens(x.ids.reshape(-1))  # [N, H]
        mask_rows = gated.repeat(b)  # [N]
        h = torch.where(mask_rows[:, None], self.mask_embedding.to(h.dtype), h)
        with self._gate(mask_rows, h.dtype, nb):
            return self.core.layers_over(
                h, pos.reshape(1, -1), store.reshape(-1), limit, n, slots, (lo, hi) if nb else None
            )

    @contextlib.contextmanager
    def _gate(self, rows: torch.Tensor, dtype: torch.dtype, blocks: int) -> Iterator[None]:
        """Adapters act at the mask slots (a 0/1 row mask, no value read on the host)."""
        if self.adapters is None or not blocks:
            yield
            return
        self.adapters.gate.rows = rows.to(dtype)[:, None]
        try:
            yield
        finally:
            self.adapters.gate.rows = None
