"""The D3D drafter: a small causal LM that drafts a whole block in one forward pass.

Design:

- The drafter is an ordinary Hugging Face causal LM plus one learned vector, the *mask
  embedding*. The vocabulary and embedding matrix are the target's, unchanged; mask slots are fed
  through ``inputs_embeds``. By default it is built from the target itself (a chosen subset of its
  layers), sharing the target's embeddings and LM head, so a checkpoint stores only its own layers,
  final norm and mask embedding, plus a JSON file naming what it was built from.
- Or it is initialised from *another* pretrained causal LM that shares the target's tokenizer
  (:meth:`D3DDrafter.from_pretrained`, ``meta.init`` names it): any width and depth, so it has
  its own embeddings and LM head (the same vocabulary; the target's cannot serve another width).
- It reads token ids only, never the target's hidden states, so it can live on its own device.
- A :class:`DraftSession` keeps the drafter's KV cache of *committed* tokens, encoded causally.
  To draft it appends ``[anchor, MASK x (B-1)]`` (anchor = the last committed token) at positions
  S..S+B-1; the block sees the whole cached prefix and all of its own slots (bidirectional) and its
  KV is dropped afterwards, since it is not a valid prefix.
- Slot j's output predicts the token at block position j+1 (the pretrained next-token
  convention), so slots 0..B-2 give the drafts d_1..d_{B-1} and their distributions q.
- Optional *draft vocabulary* (``meta.draft_vocab`` > 0): the drafter scores only the V_d target
  tokens it was trained to propose (the most frequent ones in the target's own responses), using
  those rows of the shared LM head. Its cost is B x H x V_d instead of B x H x V, and q is zero
  outside it, which both acceptance rules handle exactly (the target's residual covers the
  rest). The checkpoint stores the V_d token ids; the head rows always come from the LM head.
- Optional *gated adapters* (``meta.adapter``, :mod:`d3d.model.adapters`): the drafter's layers are the
  target's own tensors (or the ``meta.init`` model's), frozen and shared in memory, plus
  low-rank adapters that act only at the mask slots. Ungated rows (prefix, pending tokens,
  anchors) never see mask slots, so they compute exactly the frozen layers; with all of the
  target's layers the anchor's draft is the target's own next token. A checkpoint then stores
  only the adapters, the mask embedding and the draft ids (a few MB), and
  :meth:`D3DDrafter.load` rebuilds the rest from the target (or from ``meta.init``).
  :meth:`D3DDrafter.body` is the one place that knows: every forward goes through it.

Why one file of about 470 lines: the drafter is one ``nn.Module`` whose construction (from a
target's layers, from another model), placement, draft vocabulary and block forward all read and
write the same fields; the pieces that stand alone live beside it (:mod:`d3d.model.adapters`,
:mod:`d3d.model.checkpoint`, :mod:`d3d.model.skeleton`, :mod:`d3d.model.session`).

Letters: S cached length, B block size, K = B - 1 draft length, V vocab, V_d draft vocabulary,
H hidden.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from d3d.backends.hf import cache_length, trim_cache, with_cache
from d3d.config import DEFAULT_BLOCK_SIZE, SamplingConfig
from d3d.model import masks
from d3d.model.adapters import AdapterConfig, GatedAdapters, hide_gated_keys
from d3d.model.meta import (
    DRAFT_IDS_KEY,
    META_FILE,
    SHARED_KEYS,
    WEIGHTS_FILE,
    DrafterError,
    DrafterMeta,
    layer_stack,
    vocab_rows,
)
from d3d.model.session import Draft, DraftSession
from d3d.model.skeleton import layers_lm

__all__ = [  # the checkpoint names come from d3d.model.meta; importers may take them here
    "META_FILE",
    "SHARED_KEYS",
    "WEIGHTS_FILE",
    "D3DDrafter",
    "Draft",
    "DraftSession",
    "DrafterError",
    "DrafterMeta",
]

log = logging.getLogger(__name__)

IGNORE_LABEL = -100


def _sub_config(config, n_layers: int, layers: Sequence[int] | None = None):
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n_layers
    # Per-layer lists (sliding/full attention pattern) must shrink with the stack.
    if getattr(cfg, "layer_types", None) is not None:
        src = list(cfg.layer_types)
        cfg.layer_types = [src[i] for i in layers] if layers is not None else src[:n_layers]
    return cfg


class D3DDrafter(nn.Module):
    """A causal LM with a learned mask embedding that drafts blocks (see the module docstring)."""

    def __init__(
        self,
        lm: PreTrainedModel,
        meta: DrafterMeta,
        mask_embedding: torch.Tensor | None = None,
        adapters: GatedAdapters | None = None,
    ):
        super().__init__()
        self.lm = lm
        self.meta = meta
        self.adapters = adapters
        emb = lm.get_input_embeddings().weight
        # The mean row, accumulated in float32 without a float32 copy of the whole matrix.
        init = (
            emb.detach().mean(0, dtype=torch.float32) if mask_embedding is None else mask_embedding
        )
        self.mask_embedding = nn.Parameter(init.to(device=emb.device, dtype=emb.dtype).clone())
        self.register_buffer(DRAFT_IDS_KEY, None)
        self.register_buffer("draft_head", None, persistent=False)
        self.register_buffer("draft_index", None, persistent=False)
        if meta.draft_vocab:  # placeholder ids, filled by load_state_dict
            self.set_draft_vocab(torch.arange(meta.draft_vocab))
        # Whatever loads weights (a checkpoint, a training resume), the derived buffers follow.
        self.register_load_state_dict_post_hook(D3DDrafter._refresh_draft_vocab)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        layers: Sequence[int] | int = 4,
        block_size: int = DEFAULT_BLOCK_SIZE,
        base: str = "target",
        device: str | torch.device | None = None,
        adapter: AdapterConfig | None = None,
        share: bool = False,
    ) -> D3DDrafter:
        """An (untrained) drafter made of some of the target's layers, sharing its embeddings
        and LM head. ``layers`` is a count (the first N layers) or explicit indices.

        With ``adapter``, or ``share`` (a drafter that only runs inference), the layers are the
        target's own tensors, frozen (no second copy on the target's device), plus the gated
        adapters if any (see the module docstring); otherwise they are copies made straight on
        the drafter's device, trained in full. Nothing vocabulary-sized is built here: the LM
        is a meta-device skeleton filled by :func:`d3d.model.skeleton.layers_lm`."""
        src_layers = layer_stack(target)
        idx = list(range(layers)) if isinstance(layers, int) else [int(i) for i in layers]
        if not idx or any(i < 0 or i >= len(src_layers) for i in idx):
            raise DrafterError(f"layers must be indices in [0, {len(src_layers)}), got {idx}")
        cfg = _sub_config(target.config, len(idx), idx)
        adapters = None
        if adapter is not None or share:
            lm = layers_lm(target, idx, cfg)
        else:
            lm = layers_lm(target, idx, cfg, copy_to=_resolve(device or target.device))
        if adapter is not None:
            adapters = GatedAdapters(layer_stack(lm), adapter).to(target.device)
            adapters.requires_grad_(False)  # training turns on what it updates
        meta = DrafterMeta(
            base=base,
            layers=tuple(idx),
            block_size=block_size,
            vocab_size=vocab_rows(target),
            adapter=adapter.to_dict() if adapter is not None else None,
            target_layers=len(src_layers),
        )
        drafter = cls(lm, meta, adapters=adapters)
        drafter.share_embeddings(target)
        drafter.place(device or target.device)
        drafter.eval()
        return drafter

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        target: PreTrainedModel,
        device: str | torch.device | None = None,
        adapter: AdapterConfig | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> D3DDrafter:
        """An (untrained) drafter initialised from a whole pretrained causal LM that shares the
        target's tokenizer (a Hugging Face id or a folder; any width and depth), read straight to
        the drafter's device in the target's dtype. It keeps its own embeddings and LM head,
        which must have the target's vocabulary. With ``adapter`` its layers stay frozen and
        gated adapters act at the mask slots; otherwise everything but the embeddings and head
        trains (:meth:`trainable_parameters`). ``meta.init`` records ``model``."""
        from d3d.model.skeleton import pretrained_lm

        local = Path(model).expanduser()
        model = str(local.resolve()) if local.exists() else model  # a folder: where it lies
        dev = _resolve(device or target.device)
        try:
            lm = pretrained_lm(model, dev, target.dtype, target.config._attn_implementation)
        except (OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DrafterError(
                f"cannot load the drafter's initial model {model!r}: {first}"
            ) from exc
        if vocab_rows(lm) != vocab_rows(target):
            raise DrafterError(
                f"{model}: vocabulary {vocab_rows(lm)} differs from the target's {vocab_rows(target)}; "
                "a drafter must share the target's tokenizer"
            )
        lm.requires_grad_(False)  # training turns on what it updates
        depth = len(layer_stack(lm))
        adapters = None
        if adapter is not None:
            adapters = GatedAdapters(layer_stack(lm), adapter).to(dev)
            adapters.requires_grad_(False)
        meta = DrafterMeta(
            base=model,
            layers=tuple(range(depth)),
            block_size=block_size,
            shared_embeddings=False,
            vocab_size=vocab_rows(target),
            adapter=adapter.to_dict() if adapter is not None else None,
            target_layers=depth,
            init=model,
        )
        drafter = cls(lm, meta, adapters=adapters)
        drafter.eval()
        return drafter

    def share_embeddings(self, target: PreTrainedModel) -> None:
        """Use the target's input embeddings and LM head (tied or not) as the drafter's own."""
        self.lm.set_input_embeddings(target.get_input_embeddings())
        self.lm.set_output_embeddings(target.get_output_embeddings())
        self._refresh_draft_vocab()  # head rows from the new LM head

    def place(self, device: str | torch.device, dtype: torch.dtype | None = None) -> D3DDrafter:
        """Move the drafter to ``device`` (and ``dtype``) without moving its target.

        Shared embeddings / LM head are the target's modules; when the drafter goes to another
        device (its own GPU), it takes a copy of them there instead of dragging the target's
        along: one new tensor per matrix, made on ``device`` in ``dtype`` (never a copy on the
        target's device first).
        """
        dev = _resolve(device)
        emb, head = self.lm.get_input_embeddings(), self.lm.get_output_embeddings()
        if self.meta.shared_embeddings and emb.weight.device != dev:
            # Deep-copy the module objects with their parameters already replaced by the moved
            # tensors (the memo), so a tied head stays tied and nothing is copied twice.
            memo: dict = {}
            for p in {*emb.parameters(), *head.parameters()}:
                moved = p.detach().to(dev, dtype or p.dtype)
                memo[id(p)] = nn.Parameter(moved, requires_grad=p.requires_grad)
            emb, head = copy.deepcopy((emb, head), memo)
            self.lm.set_input_embeddings(emb)
            self.lm.set_output_embeddings(head)
        # Rotary frequencies keep their dtype (float32, as in the target): a bf16 drafter with
        # bf16 frequencies would compute other positions than its target's layers do.
        body = self.lm.model
        rot = body._modules.pop("rotary_emb", None)
        try:
            self.to(device=dev, dtype=dtype)
        finally:
            if rot is not None:
                body._modules["rotary_emb"] = rot.to(dev)
        return self

    def save(self, path: str | Path, dtype: torch.dtype | None = None, int8: bool = False) -> Path:
        """Write ``drafter.json`` and ``drafter.safetensors``, floating tensors in ``dtype`` if
        given, weight matrices in 8 bits if ``int8`` (see :mod:`d3d.model.checkpoint`)."""
        from d3d.model.checkpoint import save_drafter

        return save_drafter(self, path, dtype, int8=int8)

    @classmethod
    def load(
        cls, path: str | Path, target: PreTrainedModel, device: str | torch.device | None = None
    ) -> D3DDrafter:
        """Load a checkpoint written by :meth:`save`; shared (and, for an adapter drafter,
        frozen) tensors come from ``target`` (see :mod:`d3d.model.checkpoint`)."""
        from d3d.model.checkpoint import load_drafter

        return load_drafter(cls, path, target, device)

    @property
    def exact_prefix(self) -> bool:
        """True when the drafter's ungated rows compute the whole target (adapters over all of
        its layers, in order): the anchor's output is then the target's next-token logits."""
        return (
            self.adapters is not None
            and self.meta.init is None
            and self.meta.layers == tuple(range(self.meta.target_layers))
        )

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What training updates: adapters and mask embedding for an adapter drafter, else
        everything but the embeddings / LM head (the target's, shared; or a drafter's own,
        vocabulary-sized, kept as pretrained)."""
        if self.adapters is not None:
            return [self.mask_embedding, *self.adapters.parameters()]
        shared = {id(p) for p in self.lm.get_input_embeddings().parameters()}
        shared |= {id(p) for p in self.lm.get_output_embeddings().parameters()}
        return [p for p in self.parameters() if id(p) not in shared]

    # ----- draft vocabulary ---------------------------------------------------------------
    def set_draft_vocab(self, ids: torch.Tensor | Sequence[int] | None) -> None:
        """Restrict drafting to the target token ``ids`` (None: the whole vocabulary).

        The ids are a persistent buffer (saved with the checkpoint); the matching rows of the
        shared LM head (frozen) and the id -> draft index lookup are derived, never saved.
        """
        if ids is None:
            self.draft_ids = self.draft_head = self.draft_index = None
            self.meta = dataclasses.replace(self.meta, draft_vocab=0)
            return
        out = self.lm.get_output_embeddings()
        if not isinstance(out, nn.Linear) or out.bias is not None:
            raise DrafterError("a draft vocabulary needs a plain linear LM head without bias")
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().to(out.weight.device)
        vocab = out.weight.shape[0]
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise DrafterError(f"draft vocabulary ids must lie in [0, {vocab})")
        if ids.unique().numel() != ids.numel():
            raise DrafterError("draft vocabulary ids must be distinct")
        index = torch.full((vocab,), IGNORE_LABEL, dtype=torch.long, device=ids.device)
        index[ids] = torch.arange(ids.numel(), device=ids.device)
        self.register_buffer(DRAFT_IDS_KEY, ids.clone(), persistent=True)
        self.register_buffer("draft_head", out.weight.detach()[ids].clone(), persistent=False)
        self.register_buffer("draft_index", index, persistent=False)
        self.meta = dataclasses.replace(self.meta, draft_vocab=int(ids.numel()))

    def _refresh_draft_vocab(self, *_hook_args) -> None:
        """Rebuild the derived buffers from ``draft_ids`` (after new weights or a new LM head)."""
        if self.draft_ids is not None:
            self.set_draft_vocab(self.draft_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-space logits of hidden states: [..., H] -> [..., V_d] (V_d = V without a
        draft vocabulary)."""
        if self.draft_head is None:
            return self.lm.get_output_embeddings()(hidden)
        return F.linear(hidden, self.draft_head.to(hidden.dtype))

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Map draft-space indices to target token ids."""
        return idx if self.draft_ids is None else self.draft_ids.to(idx.device)[idx]

    def to_draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Map target token ids to draft-space indices; tokens outside it (and ``IGNORE_LABEL``)
        become ``IGNORE_LABEL``."""
        if self.draft_index is None:
            return labels
        valid = (labels >= 0) & (labels < self.draft_index.numel())
        out = torch.full_like(labels, IGNORE_LABEL)
        out[valid] = self.draft_index.to(labels.device)[labels[valid]]
        return out

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-space logits [..., V_d] -> target-vocabulary logits [..., V] (-inf outside)."""
        if self.draft_ids is None:
            return logits
        vocab = self.draft_index.numel()
        full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
        full[..., self.draft_ids.to(logits.device)] = logits
        return full

    def session(
        self, sampling: SamplingConfig | None = None, generator: torch.Generator | None = None
    ) -> DraftSession:
        """Open a per-request drafting session (its own cache of committed tokens)."""
        return DraftSession(self, sampling, generator)

    # ----- forward passes -----------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.meta.block_size

    @property
    def device(self) -> torch.device:
        return self.mask_embedding.device

    def block_embeds(self, anchors: torch.Tensor) -> torch.Tensor:
        """Input embeddings of blocks ``[anchor, MASK x (B-1)]``: anchors [N] -> [N, B, H]."""
        emb = self.lm.get_input_embeddings()(anchors.to(self.device)).unsqueeze(1)
        masks_ = self.mask_embedding.view(1, 1, -1).expand(
            anchors.shape[0], self.block_size - 1, -1
        )
        return torch.cat([emb, masks_.to(emb.dtype)], dim=1)

    def encode(self, ids: Sequence[int], cache: DynamicCache) -> None:
        """Append committed tokens to the cache, causally (no logits kept)."""
        if not ids:
            return
        s = cache_length(cache)
        x = torch.tensor([list(ids)], device=self.device)
        pos = torch.arange(s, s + x.shape[1], device=self.device).unsqueeze(0)
        self.body(self.lm.get_input_embeddings()(x), pos, None, cache)

    def body(
        self,
        embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache | None,
        mask_slots: torch.Tensor | None = None,
        ragged: dict | None = None,
    ) -> torch.Tensor:
        """The drafter's layers: embeds [1, Q, H] -> hidden states [1, Q, H] (final norm applied).

        Every drafter forward goes through here. ``mask_slots`` [Q] bool marks the positions fed
        the mask embedding (None: none of them); a drafter whose weights act differently at mask
        slots (adapters) reads it here, so callers never need to know. With adapters, they act at
        the mask slots only, and the other rows are kept from seeing mask slots, so they compute
        exactly the frozen layers' causal forward. ``ragged``: the keyword arguments of a ragged
        forward over several sessions (:func:`d3d.worker.drafting.draft_blocks`), whose segments
        carry their own masks (mask slots already hidden from the other rows).
        """
        kwargs = with_cache(self.lm.model, cache) if cache is not None else {}
        kwargs.update(ragged or {})
        gate = contextlib.nullcontext()
        if self.adapters is not None:
            slots = None if mask_slots is None else mask_slots.to(embeds.device, torch.bool)
            if slots is not None and ragged is None:
                attention_mask = hide_gated_keys(attention_mask, slots, cache_length(cache))
            gate = self.adapters.gated(slots)
        with gate:
            out = self.lm.model(
                inputs_embeds=embeds,
                position_ids=position_ids,
                attention_mask=attention_mask,
                **kwargs,
            )
        return out.last_hidden_state

    def block_scores(
        self, anchor: int, cache: DynamicCache, pending: Sequence[int] = ()
    ) -> torch.Tensor:
        """Draft-space logits [K, V_d] of one block ``[anchor, MASK x K]`` after the cached prefix.

        ``pending`` committed tokens (between the cache and the anchor) are encoded into the
        cache in the same forward, causally, so a round costs one drafter pass; the block's own
        KV is dropped, leaving the cache at S + len(pending).
        """
        s, t, b = cache_length(cache), len(pending), self.block_size
        embeds = self.block_embeds(torch.tensor([anchor], device=self.device))
        if t:
            new = self.lm.get_input_embeddings()(torch.tensor([list(pending)], device=self.device))
            embeds = torch.cat([new, embeds], dim=1)
        mask = masks.to_model_mask(
            masks.extend_block_mask(s, t, b, self.device),
            self.lm.config._attn_implementation,
            embeds.dtype,
        )
        slots = torch.zeros(t + b, dtype=torch.bool, device=self.device)
        slots[t + 1 :] = True
        hidden = self.body(
            embeds,
            torch.arange(s, s + t + b, device=self.device).unsqueeze(0),
            mask,
            cache,
            slots,
        )
        trim_cache(cache, b)
        return self.head(hidden[0, t : t + b - 1])

    def block_logits(
        self, anchor: int, cache: DynamicCache, pending: Sequence[int] = ()
    ) -> torch.Tensor:
        """Target-vocabulary logits [K, V] of one block (see :meth:`block_scores`)."""
        return self.full_logits(self.block_scores(anchor, cache, pending))


def _resolve(device: str | torch.device) -> torch.device:
    """A torch device with the current CUDA index filled in (``cuda`` -> ``cuda:N``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
