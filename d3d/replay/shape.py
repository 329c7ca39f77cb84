"""The replay's optional drafter shape: real drafter forwards whose outputs are thrown away.

A replay alone costs nothing to draft, which measures the engine with a free drafter. Naming a
shape (``replay:7.88:0.78:self:4``, ``replay:7.88:shape=qwen3-8b@31``) makes every block and
branch the replay proposes also run as a forward of that drafter, on the request's real
committed tokens, so drafting takes what it would take with a trained drafter of that size.

- a drafter spec shape is built by the engine's loader (:func:`d3d.engine.build_drafter`, which
  hands it to :func:`d3d.replay.build_replay`); :func:`random_shape` builds
  ``shape=CONFIG[@LAYERS]``, random weights of a model config (a shipped name under
  ``d3d/configs``, or a ``config.json``: :mod:`d3d.model.shapes`) cut to LAYERS layers, made on
  the drafter's device in the target's dtype. Its vocabulary need not be the target's: ids are
  folded into it.
- ``sync`` runs the shape in a :class:`~d3d.model.session.DraftSession` (its cache of committed
  tokens, one block forward a round).
- ``async``'s forwards run in the worker as the D3D worker runs them (:func:`shape_forwards`
  picks): :class:`ShapeForwards` as the row-by-row server (:mod:`d3d.worker.drafting`: every
  miss of a step in one forward where the drafter allows, then per row its draft chain plus one
  block per branch in one forward), or, where the cuda backend readied the shape for packed
  drafting, :class:`PackedShapeForwards` as :class:`~d3d.worker.packed.PackedDraftServer`
  (its slot KV; every miss in one forward, every row's chain and branches in one more,
  captured on a GPU), so a replay's drafting costs there what the D3D worker's costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from d3d.backends.slabs import KvRow
from d3d.model.drafter import D3DDrafter, DrafterError
from d3d.model.session import rewind
from d3d.model.shapes import load_config, random_model
from d3d.worker.drafting import can_batch, draft_blocks, draft_branches
from d3d.worker.packed import cut_back

SHAPE_PREFIX = "shape="


def shape_vocab(drafter: D3DDrafter) -> int:
    return int(drafter.lm.get_input_embeddings().num_embeddings)


def fold(ids: Sequence[int], vocab: int) -> list[int]:
    """Target ids as ids of a shape's vocabulary (the same ids where it is as large)."""
    return [int(t) % vocab for t in ids]


def is_random(shape: str) -> bool:
    """Whether a replay's shape names random weights of a config (else: a drafter spec)."""
    return shape.startswith(SHAPE_PREFIX)


def random_shape(shape: str, device: str | torch.device, dtype: torch.dtype) -> D3DDrafter:
    """``shape=CONFIG[@LAYERS]``: a random-weight drafter of that config's first LAYERS layers."""
    text = shape.removeprefix(SHAPE_PREFIX)
    name, _, layers = text.partition("@")
    try:
        _, cfg = load_config(name)
        depth = int(layers) if layers else int(cfg.num_hidden_layers)
    except ValueError as exc:  # ShapeError included
        raise DrafterError(f"replay shape {text!r}: {exc}") from None
    if not 1 <= depth <= int(cfg.num_hidden_layers):
        raise DrafterError(
            f"replay shape {text!r}: layers must be in 1..{cfg.num_hidden_layers}, got {depth}"
        )
    lm = random_model(cfg, device, dtype, depth)
    return D3DDrafter.from_target(lm, depth, base=f"{SHAPE_PREFIX}{text}", share=True)


Outcomes = Sequence[tuple[int, int]]  # (k accepted, the target's token r) of each branch
BranchRow = tuple[int, Sequence[int], Sequence[int], Outcomes]  # sid, committed, drafts, outcomes


def shape_forwards(drafter: D3DDrafter, branches: int) -> ShapeForwards | PackedShapeForwards:
    """The shape's forwards as the worker would run that drafter's (module docstring), for
    at most ``branches`` branches a row."""
    from d3d.worker.packed_check import proven_plan

    plan = proven_plan(drafter)
    return ShapeForwards(drafter) if plan is None else PackedShapeForwards(drafter, plan, branches)


class ShapeForwards:
    """``async``'s drafter forwards of a shape, per row, for their time only.

    Per row a cache of its committed tokens (folded into the shape's vocabulary) but the last,
    cut back and extended as the D3D worker's session caches are; after branches it also holds
    the draft chain they needed, which the next commit cuts back to what was accepted.
    """

    together = False  # a row's branches a forward of their own

    def __init__(self, drafter: D3DDrafter):
        self.drafter = drafter
        self.vocab = shape_vocab(drafter)
        self.caches: dict[int, tuple[DynamicCache, list[int]]] = {}

    def drop(self, sid: int) -> None:
        self.caches.pop(sid, None)

    def check(self, tokens: int) -> None:
        """Nothing to refuse: a row's cache grows as it needs."""

    def _read(self, sid: int, committed: Sequence[int]) -> tuple[DynamicCache, list[int], int]:
        """The row's cache cut back to the committed tokens but the last; the ones it still
        lacks; the anchor."""
        ids = fold(committed, self.vocab)
        cache, cached = self.caches.get(sid, (DynamicCache(), []))
        cache, cached, pending = rewind(cache, cached, ids[:-1])
        self.caches[sid] = (cache, ids[:-1])  # what it holds once the forward read `pending`
        return cache, pending, ids[-1]

    @torch.inference_mode()
    def blocks(self, rows: Sequence[tuple[int, Sequence[int]]]) -> None:
        """A block forward for each (row id, committed tokens): the misses of a step."""
        d = self.drafter
        items = [self._read(sid, committed) for sid, committed in rows]
        if len(items) > 1 and can_batch(d):
            draft_blocks(d, items)
        else:
            for cache, pending, anchor in items:
                d.block_scores(anchor, cache, pending)

    def branches(self, rows: Sequence[BranchRow]) -> bool:
        """Each row's branches in a forward of its own (:meth:`branch`); whether one also
        read committed tokens its cache lacked."""
        return any([self.branch(*row) for row in rows])

    @torch.inference_mode()
    def branch(
        self, sid: int, committed: Sequence[int], drafts: Sequence[int], outcomes: Outcomes
    ) -> bool:
        """One forward: the chain ``[pending, anchor, d_1..d_m]`` the ``outcomes`` (k, r)
        need (m = their largest k) and a block per outcome, seeing the chain up to d_k.
        Whether it also read committed tokens the cache lacked (a prompt, a catch-up)."""
        cache, pending, anchor = self._read(sid, committed)
        m = max(k for k, _ in outcomes)
        chain = [*pending, anchor, *fold(drafts[:m], self.vocab)]
        visible = [len(committed) + k for k, _ in outcomes]
        anchors = fold([max(r, 0) for _, r in outcomes], self.vocab)
        draft_branches(self.drafter, cache, visible, anchors, chain)
        self.caches[sid] = (cache, [*fold(committed, self.vocab), *chain[len(pending) + 1 :]])
        return bool(pending)


class PackedShapeForwards:
    """The same forwards through the cuda backend's packed drafter: a slot per row, a step's
    misses in one forward, every row's chain and branches in one more (rows given fewer
    outcomes than the most repeat their first: the real server drafts n for every row)."""

    together = True  # every row's branches in one forward

    def __init__(self, drafter: D3DDrafter, plan, branches: int):
        from d3d.backends.cuda.drafter import PackedDrafter

        self.packed = PackedDrafter(drafter, plan)
        self.vocab = shape_vocab(drafter)
        # positions past a row's tokens a step may write: a chain and its branch blocks
        self.reserve = self.packed.reserve(branches)
        self.rows: dict[int, tuple[KvRow, list[int]]] = {}  # sid: its slot, the ids it holds

    def drop(self, sid: int) -> None:
        got = self.rows.pop(sid, None)
        if got is not None:
            self.packed.close(got[0])

    def check(self, tokens: int) -> None:
        """Raise :class:`~d3d.backends.cuda.kv.SlotLimitError` where a row of ``tokens``
        committed tokens cannot take a step in its slot (it fails alone, before the step)."""
        self.packed.check_room(tokens, self.reserve)

    def _read(self, sid: int, committed: Sequence[int]) -> tuple[KvRow, list[int], int]:
        """The row's slot cut back to the committed tokens but the last; the ones it still
        lacks; the anchor."""
        ids = fold(committed, self.vocab)
        if sid not in self.rows:
            self.rows[sid] = (self.packed.open(len(ids) + self.reserve), [])
        row, held = self.rows[sid]
        return row, cut_back(row, held, ids[:-1]), ids[-1]

    @torch.inference_mode()
    def blocks(self, rows: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Every missed row's block in one packed forward."""
        items = [self._read(sid, committed) for sid, committed in rows]
        visible = torch.tensor([[row.length + len(pending)] for row, pending, _ in items])
        anchors = torch.tensor([[anchor] for _, _, anchor in items])
        self.packed.run([row for row, _, _ in items], [p for _, p, _ in items], visible, anchors)
        for (sid, committed), (row, _, _) in zip(rows, items, strict=True):
            self.rows[sid] = (row, fold(committed, self.vocab)[:-1])

    @torch.inference_mode()
    def branches(self, rows: Sequence[BranchRow]) -> bool:
        """Every row's chain ``[pending, anchor, d_1..d_m]`` and its blocks, one per outcome
        seeing the chain up to d_k, in one packed forward; whether a row also read committed
        tokens its slot lacked."""
        width = max(len(outcomes) for *_, outcomes in rows)
        slots, chains, visible, anchors, held = [], [], [], [], {}
        reads = False
        for sid, committed, drafts, outcomes in rows:
            row, pending, anchor = self._read(sid, committed)
            reads = reads or bool(pending)
            padded = [*outcomes, *[outcomes[0]] * (width - len(outcomes))]
            m = max(k for k, _ in outcomes)
            slots.append(row)
            chains.append([*pending, anchor, *fold(drafts[:m], self.vocab)])
            visible.append([len(committed) + k for k, _ in padded])
            anchors.append(fold([max(r, 0) for _, r in padded], self.vocab))
            held[sid] = (row, fold([*committed, *drafts[:m]], self.vocab))  # once it has run
        self.packed.run(slots, chains, torch.tensor(visible), torch.tensor(anchors))
        self.rows.update(held)
        return reads
