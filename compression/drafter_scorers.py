"""Scorers that read the prompt with the drafter.

``drafter-attention`` (the D3D way). The *reader* is the first ``layers`` layers of the drafter's
LM (or of the target: ``reader="target"``), copied into a model of their own that shares the
embeddings and LM head and carries the drafter's mask embedding. A layer costs about 1/30 of the
SmolLM2 target's prefill; optional int8 dynamic quantisation of the reader's linear layers halves
that again on CPU. How many layers are needed is an empirical question per model: for SmolLM2 the
first 4 layers rank context at chance, head 7 of layer 7 finds evidence (docs/longbench.md).

1. Prefill ``prefix + context`` with sdpa (no attention weights are materialised).
2. Run only the final tokens on top of that cache with eager attention and
   ``output_attentions=True``: the suffix (question, instruction tail, assistant header), and
   optionally one appended draft block ``[anchor, MASK x (B-1)]`` as look-ahead, with a 4D mask
   (the suffix is causal; the block sees everything and itself bidirectionally). The weights
   from those Q queries onto the C context keys are small: [layers, heads, Q, C].
3. Reduce over layers, heads and queries (SpecPrefill: max, max, mean), optionally smooth.

Contexts longer than the scoring window are scored in windows: each window is read after the
same prefix and followed by the same final tokens, from position 0.

``drafter-ppl`` (LLMLingua-style self-information): the drafter's own next-token loss on each
context token, -log q(x_i | x_<i), read in the same windows; question-agnostic.

Letters: S cached length, Q query tokens, C context tokens, H hidden, V vocab.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from compression.prompt import PromptParts
from compression.selection import smooth
from d3d import masks
from d3d.config import DEFAULT_BLOCK_SIZE
from d3d.drafter import D3DDrafter
from d3d.hf import with_cache

REDUCTIONS = ("max", "mean")


@dataclass(frozen=True)
class AttentionScoring:
    """Settings of the drafter-attention scorer.

    ``reader``: whose first ``layers`` layers read the prompt, the drafter's LM or the target's.
    ``heads``: (layer, head) pairs to use instead of reducing over all layers and heads.
    """

    layers: int = 4
    layer_reduce: str = "max"
    head_reduce: str = "max"
    query_reduce: str = "mean"
    lookahead: bool = True
    smooth_kernel: int = 1
    window: int | None = None
    heads: tuple[tuple[int, int], ...] | None = None
    quantize: bool = False
    reader: str = "drafter"

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"score layers must be >= 1, got {self.layers}")
        for name in ("layer_reduce", "head_reduce", "query_reduce"):
            if getattr(self, name) not in REDUCTIONS:
                raise ValueError(f"{name} must be max or mean, got {getattr(self, name)!r}")
        if self.smooth_kernel < 1 or self.smooth_kernel % 2 == 0:
            raise ValueError(f"smooth kernel must be odd and >= 1, got {self.smooth_kernel}")
        if self.window is not None and self.window < 64:
            raise ValueError(f"scoring window must be >= 64 tokens, got {self.window}")
        if self.reader not in ("drafter", "target"):
            raise ValueError(f"scoring reader must be drafter or target, got {self.reader!r}")
        for layer, head in self.heads or ():
            if not 0 <= layer < self.layers or head < 0:
                raise ValueError(
                    f"head ({layer}, {head}) is outside the {self.layers} scoring layers"
                )


def scoring_model(
    source: PreTrainedModel,
    layers: int | None,
    quantize: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    mask_embedding: torch.Tensor | None = None,
) -> D3DDrafter:
    """The first ``layers`` layers of ``source`` (the drafter's LM or the target) as a model of
    their own (own config, shared embeddings and LM head), with the drafter's mask embedding.

    ``quantize`` swaps the decoder layers' linear maps for dynamic int8 ones (CPU only): about
    2x faster prefill; embeddings and LM head stay fp32.
    """
    n = len(source.model.layers)
    k = n if layers is None else min(layers, n)
    sub = D3DDrafter.from_target(source, k, block_size=block_size, base="scoring")
    if mask_embedding is not None:
        with torch.no_grad():
            sub.mask_embedding.copy_(mask_embedding)
    if quantize and sub.device.type == "cpu":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.quantization import quantize_dynamic

            # In place: the layers must keep sharing the model's config object, which is how
            # the attention implementation is switched for the query pass.
            quantize_dynamic(
                sub.lm.model.layers, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
            )
    return sub


@contextlib.contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """Temporarily switch a model's attention implementation (sdpa <-> eager)."""
    old = model.config._attn_implementation
    if old == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def windows(n: int, size: int) -> list[tuple[int, int]]:
    """Consecutive context windows ``[start, end)`` of at most ``size`` tokens."""
    if size < 1:
        raise ValueError("the scoring window cannot hold the prompt's instruction and question")
    return [(s, min(s + size, n)) for s in range(0, n, size)] or [(0, 0)]


def _reduce(x: torch.Tensor, how: str, dim: int) -> torch.Tensor:
    return x.amax(dim=dim) if how == "max" else x.mean(dim=dim)


def _window_size(model: D3DDrafter, parts: PromptParts, extra: int, window: int | None) -> int:
    limit = window or int(getattr(model.lm.config, "max_position_embeddings", 8192))
    return limit - len(parts.prefix) - len(parts.suffix) - extra


class DrafterAttentionScorer:
    """Attention from the final tokens (and a draft block) onto the context; see the docstring."""

    name = "drafter-attention"
    token_level = False

    def __init__(
        self,
        source: PreTrainedModel,
        cfg: AttentionScoring | None = None,
        mask_embedding: torch.Tensor | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        self.cfg = cfg or AttentionScoring()
        if self.cfg.layers > len(source.model.layers):
            raise ValueError(
                f"score layers ({self.cfg.layers}) exceed the reader's {len(source.model.layers)} layers"
            )
        self.model = scoring_model(
            source, self.cfg.layers, self.cfg.quantize, block_size, mask_embedding
        )

    def _final_inputs(self, suffix: Sequence[int], s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings [1, Q, H] and bool mask [1, 1, Q, S + Q] of the query tokens."""
        lm, dev = self.model.lm, self.model.device
        ids = torch.tensor([list(suffix)], device=dev)
        if not self.cfg.lookahead:
            return lm.get_input_embeddings()(ids), masks.causal_mask(s, len(suffix), dev)
        # The suffix's last token is the anchor of the look-ahead block, as in drafting.
        head = lm.get_input_embeddings()(ids[:, :-1])
        block = self.model.block_embeds(ids[0, -1:])
        q_len = head.shape[1] + block.shape[1]
        mask = masks.causal_mask(s, q_len, dev).clone()
        mask[..., head.shape[1] :, :] = True
        return torch.cat([head, block], dim=1), mask

    @torch.inference_mode()
    def attention(self, parts: PromptParts, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Attention weights from the final tokens onto context[start:end]: [L, heads, Q, C]."""
        lm, dev = self.model.lm, self.model.device
        ctx = list(parts.context[start:end])
        ids = torch.tensor([[*parts.prefix, *ctx]], device=dev)
        s = ids.shape[1]
        cache = DynamicCache()
        lm.model(
            input_ids=ids,
            position_ids=torch.arange(s, device=dev).unsqueeze(0),
            **with_cache(lm.model, cache),
        )
        embeds, mask = self._final_inputs(parts.suffix, s)
        q_len = embeds.shape[1]
        with attention_implementation(lm, "eager"):
            out = lm.model(
                inputs_embeds=embeds,
                position_ids=torch.arange(s, s + q_len, device=dev).unsqueeze(0),
                attention_mask=masks.to_model_mask(mask, "eager", embeds.dtype),
                output_attentions=True,
                **with_cache(lm.model, cache),
            )
        p = len(parts.prefix)
        return torch.stack([a[0, :, :, p:s] for a in out.attentions]).float()

    def reduce(self, a: torch.Tensor) -> torch.Tensor:
        """Attention [L, heads, Q, C] -> token scores [C]."""
        if self.cfg.heads:
            # Chosen (retrieval) heads: mean over queries per head, then the reduction over heads.
            picked = torch.stack([a[layer, head] for layer, head in self.cfg.heads])
            return _reduce(_reduce(picked, self.cfg.query_reduce, 1), self.cfg.head_reduce, 0)
        a = _reduce(a, self.cfg.layer_reduce, 0)
        a = _reduce(a, self.cfg.head_reduce, 0)
        return _reduce(a, self.cfg.query_reduce, 0)

    def score(self, parts: PromptParts) -> torch.Tensor:
        extra = self.model.block_size - 1 if self.cfg.lookahead else 0
        size = _window_size(self.model, parts, extra, self.cfg.window)
        out = []
        for start, end in windows(len(parts.context), size):
            if end == start:
                continue
            out.append(self.reduce(self.attention(parts, start, end)))
        scores = torch.cat(out) if out else torch.zeros(0)
        return smooth(scores, self.cfg.smooth_kernel)


class DrafterPerplexityScorer:
    """Self-information of each context token under the drafter (LLMLingua-style)."""

    name = "drafter-ppl"
    token_level = False

    def __init__(
        self, source: PreTrainedModel, layers: int | None = None, window: int | None = None
    ):
        self.model = scoring_model(source, layers)
        self.window = window
        self.head_rows = 1024

    @torch.inference_mode()
    def _self_information(self, parts: PromptParts, start: int, end: int) -> torch.Tensor:
        lm, dev = self.model.lm, self.model.device
        ctx = list(parts.context[start:end])
        ids = torch.tensor([[*parts.prefix, *ctx]], device=dev)
        hidden = lm.model(input_ids=ids, use_cache=False).last_hidden_state[0]  # [S, H]
        p = len(parts.prefix)
        # Hidden state i predicts token i+1; the first context token is predicted from the prefix
        # (or gets the mean score when there is no prefix).
        first = max(p - 1, 0)
        h = hidden[first : p + len(ctx) - 1]
        targets = ids[0, first + 1 : p + len(ctx)]
        info = []
        for r in range(0, h.shape[0], self.head_rows):
            logits = lm.lm_head(h[r : r + self.head_rows]).float()
            logp = torch.log_softmax(logits, dim=-1)
            info.append(-logp.gather(1, targets[r : r + self.head_rows, None])[:, 0])
        out = torch.cat(info) if info else torch.zeros(0)
        if p == 0 and len(ctx):
            out = torch.cat([out.mean().reshape(1) if out.numel() else torch.zeros(1), out])
        return out

    def score(self, parts: PromptParts) -> torch.Tensor:
        size = _window_size(self.model, parts, 0, self.window)
        out = [
            self._self_information(parts, s, e)
            for s, e in windows(len(parts.context), size)
            if e > s
        ]
        return torch.cat(out) if out else torch.zeros(0)
