"""Scorers that read the prompt with the drafter.

``drafter-attention`` (the D3D way). The *reader* is the drafter itself (``reader="drafter"``,
the default: the shipped drafter, whatever its build, through :meth:`D3DDrafter.body`), or the
target's first layers copied into a model of their own that shares the embeddings and LM head
(``reader="target"``). Every forward goes through ``body``, so a drafter whose layers act
differently at mask slots (adapters) reads the look-ahead block as it drafts.

1. *Document pass*: ``prefix + context`` through ``body`` with sdpa into a KV cache, stopping
   as soon as layer ``depth - 1`` has cached its keys and values (early exit: that layer's
   attention output and MLP, and every deeper layer, are never run; about one layer in eight
   saved at depth 8). At full depth this cache is the drafter's prefill of the whole prompt
   (less the last layer's output, which the next forward does not need).
2. *Query pass*: the suffix (question, instruction tail, assistant header), and optionally one
   appended draft block ``[anchor, MASK x (B-1)]`` as look-ahead, on top of that cache, with
   eager attention on the chosen layers and sdpa on the others (4D mask: the suffix is causal;
   the block sees everything and itself bidirectionally). Hooks on the chosen layers' attention modules catch the weights from those
   Q queries onto the C context keys: [layers, heads, Q, C]. The query's KV is then cut off, so
   the document pass can serve the next question (:mod:`compression.doc_cache`).
3. Reduce over layers, heads and queries (SpecPrefill: max, max, mean), or take chosen
   (retrieval) heads, optionally smooth.

Contexts longer than ``window`` (default: the reader's position limit) are read in windows, each
after the same prefix and followed by the same query, from position 0; windows also make the
document pass linear in length. Windows are independent, so they are read side by side on the
cores, one torch thread each (:mod:`compression.reading`; the same numbers as one after another).

``drafter-ppl`` (LLMLingua-style self-information): the drafter's own next-token loss on each
context token, -log q(x_i | x_<i), read in the same windows; question-agnostic.

Letters: S cached length, Q query tokens, C context tokens, H hidden, V vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from compression.doc_cache import DocumentCache, DocumentReading, WindowCache, content_key
from compression.prompt import PromptParts
from compression.reader_model import quantized_copy, scoring_model, weights_id
from compression.reading import (
    CAPTURE,
    AttentionCapture,
    EarlyExit,
    attention_implementation,
    early_exit,
    parallel_map,
    reader_workers,
    stop_after_caching,
    windows,
)
from compression.selection import smooth
from compression.units import Chunk
from d3d.backends.hf import trim_cache
from d3d.backends.sizes import UNSTATED_WINDOW, window
from d3d.config import DEFAULT_BLOCK_SIZE
from d3d.model import masks
from d3d.model.drafter import D3DDrafter

REDUCTIONS = ("max", "mean")


@dataclass(frozen=True)
class AttentionScoring:
    """Settings of the drafter-attention scorer.

    ``reader``: the drafter itself, or the target's first ``layers`` layers.
    ``workers``: windows read at once (None: one per core, one torch thread each).
    ``layers``: how deep the document pass goes (early exit; None: down to the deepest chosen
    head, or the whole reader). ``heads``: (layer, head) pairs to use instead of reducing over
    all layers and heads.
    """

    layers: int | None = None
    layer_reduce: str = "max"
    head_reduce: str = "max"
    query_reduce: str = "mean"
    lookahead: bool = True
    smooth_kernel: int = 1
    window: int | None = None
    heads: tuple[tuple[int, int], ...] | None = None
    quantize: bool = False
    reader: str = "drafter"
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"score layers must be >= 1, got {self.layers}")
        for name in ("layer_reduce", "head_reduce", "query_reduce"):
            if getattr(self, name) not in REDUCTIONS:
                raise ValueError(f"{name} must be max or mean, got {getattr(self, name)!r}")
        if self.smooth_kernel < 1 or self.smooth_kernel % 2 == 0:
            raise ValueError(f"smooth kernel must be odd and >= 1, got {self.smooth_kernel}")
        if self.window is not None and self.window < 64:
            raise ValueError(f"scoring window must be >= 64 tokens, got {self.window}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"scoring workers must be >= 1, got {self.workers}")
        if self.reader not in ("drafter", "target"):
            raise ValueError(f"scoring reader must be drafter or target, got {self.reader!r}")
        if self.reader == "target" and self.layers is None:
            raise ValueError("a target reader needs --score-layers (how many layers to copy)")
        for layer, head in self.heads or ():
            if layer < 0 or head < 0 or (self.layers is not None and layer >= self.layers):
                raise ValueError(f"head ({layer}, {head}) is outside the scoring layers")

    @property
    def depth(self) -> int | None:
        """Layers the document pass runs (None: all of the reader's)."""
        if self.layers is not None:
            return self.layers
        return max(layer for layer, _ in self.heads) + 1 if self.heads else None


def _reduce(x: torch.Tensor, how: str, dim: int) -> torch.Tensor:
    return x.amax(dim=dim) if how == "max" else x.mean(dim=dim)


QUERY_RESERVE = 512  # positions kept for the query after a window that fills the reader's limit


def _positions(model: D3DDrafter) -> int:
    return window(model.lm.config) or UNSTATED_WINDOW


def _window_size(model: D3DDrafter, parts: PromptParts, extra: int, window: int | None) -> int:
    """Context tokens per window. The same for every question about a document (a reading is
    cached per document, and scores must not depend on which question read it first):
    ``window`` tokens of prefix and context, the query placed after them; without ``window``,
    the reader's position limit less the prefix, the look-ahead block and a fixed reserve for
    the query."""
    if window is not None:
        return window - len(parts.prefix)
    limit = _positions(model)
    return limit - len(parts.prefix) - extra - min(QUERY_RESERVE, limit // 4)


def _check_query_fits(model: D3DDrafter, parts: PromptParts, size: int, extra: int) -> None:
    need = len(parts.prefix) + size + len(parts.suffix) + extra
    if need > _positions(model):
        raise ValueError(
            f"the question ({len(parts.suffix)} tokens with the instruction's tail) does not fit "
            f"after a scoring window: {need} positions, the reader has {_positions(model)}"
        )


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
        """Read with the first ``cfg.layers`` layers of ``source`` (a target model)."""
        cfg = cfg or AttentionScoring(reader="target", layers=len(source.model.layers))
        if cfg.layers is not None and cfg.layers > len(source.model.layers):
            raise ValueError(
                f"score layers ({cfg.layers}) exceed the reader's {len(source.model.layers)} layers"
            )
        model = scoring_model(source, cfg.layers, cfg.quantize, block_size, mask_embedding)
        self._setup(model, cfg, weights_id(source.model.layers, model.mask_embedding, cfg.depth))

    @classmethod
    def from_drafter(
        cls, drafter: D3DDrafter, cfg: AttentionScoring | None = None
    ) -> DrafterAttentionScorer:
        """Read with the drafter itself (an int8 copy of it when ``cfg.quantize``)."""
        cfg = cfg or AttentionScoring()
        n = len(drafter.lm.model.layers)
        if (cfg.depth or n) > n:
            raise ValueError(f"score layers ({cfg.depth}) exceed the drafter's {n} layers")
        self = cls.__new__(cls)
        identity = weights_id(drafter.lm.model.layers, drafter.mask_embedding, cfg.depth)
        self._setup(quantized_copy(drafter) if cfg.quantize else drafter, cfg, identity)
        return self

    def _setup(self, model: D3DDrafter, cfg: AttentionScoring, identity: str = "") -> None:
        self.model = model
        self.cfg = cfg
        self.identity = identity or str(id(model))
        n = len(model.lm.model.layers)
        self.depth = min(cfg.depth or n, n)
        self.layers = sorted({i for i, _ in cfg.heads}) if cfg.heads else list(range(self.depth))
        self.cache: DocumentCache | None = None
        self.full_depth = self.depth == n and not cfg.quantize

    # ----- the two passes ---------------------------------------------------------------------
    def _final_inputs(self, suffix: Sequence[int], s: int):
        """Embeddings [1, Q, H], bool mask [1, 1, Q, S + Q] and mask slots [Q] of the queries."""
        lm, dev = self.model.lm, self.model.device
        ids = torch.tensor([list(suffix)], device=dev)
        if not self.cfg.lookahead:
            q = len(suffix)
            slots = torch.zeros(q, dtype=torch.bool, device=dev)
            return lm.get_input_embeddings()(ids), masks.causal_mask(s, q, dev), slots
        # The suffix's last token is the anchor of the look-ahead block, as in drafting.
        head = lm.get_input_embeddings()(ids[:, :-1])
        block = self.model.block_embeds(ids[0, -1:])
        h, q = head.shape[1], head.shape[1] + block.shape[1]
        mask = masks.causal_mask(s, q, dev).clone()
        mask[..., h:, :] = True
        slots = torch.zeros(q, dtype=torch.bool, device=dev)
        slots[h + 1 :] = True
        return torch.cat([head, block], dim=1), mask, slots

    @torch.inference_mode()
    def read_window(self, prefix: Sequence[int], ctx: Sequence[int]) -> DynamicCache:
        """The document pass over ``prefix + ctx``: a cache of the first ``depth`` layers.

        Each window is one causal forward from position 0 into an empty cache (the prefix is
        read again per window): sdpa then skips the masked half of the attention, about 20 %
        of the pass at 1,024 tokens against continuing from a shared prefix cache, and an int8
        reader's activation scales see the same rows as in calibration."""
        dev = self.model.device
        cache = DynamicCache()
        ids = torch.tensor([[*prefix, *ctx]], device=dev)
        if ids.shape[1] == 0:
            return cache
        emb = self.model.lm.get_input_embeddings()(ids)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        with stop_after_caching(cache, self.depth - 1):
            self.model.body(emb, pos, None, cache)
        return cache

    @contextlib.contextmanager
    def query_mode(self) -> Iterator[AttentionCapture]:
        """Capturing attention (eager on the chosen layers), the capture hooks and the early
        exit, held around query passes (from any number of threads; no document pass may run
        meanwhile)."""
        layers = self.model.lm.model.layers
        with (
            attention_implementation(self.model.lm, CAPTURE),
            AttentionCapture({i: layers[i].self_attn for i in self.layers}) as capture,
            early_exit(layers, self.depth),
        ):
            yield capture

    @torch.inference_mode()
    def _query(
        self, capture: AttentionCapture, cache: DynamicCache, suffix: Sequence[int], p: int
    ) -> torch.Tensor:
        s = int(cache.get_seq_length())
        embeds, mask, slots = self._final_inputs(suffix, s)
        q = embeds.shape[1]
        pos = torch.arange(s, s + q, device=self.model.device).unsqueeze(0)
        model_mask = masks.to_model_mask(mask, "eager", embeds.dtype)
        with contextlib.suppress(EarlyExit):
            self.model.body(embeds, pos, model_mask, cache, slots)
        trim_cache(cache, q)  # every cached layer ran the query: the document pass is intact
        got = capture.take()
        return torch.stack([got[i][:, :, p:s] for i in self.layers]).float()

    def query(self, cache: DynamicCache, suffix: Sequence[int], p: int) -> torch.Tensor:
        """The query pass on a document cache: weights [L, heads, Q, C] (cache left as it was)."""
        with self.query_mode() as capture:
            return self._query(capture, cache, suffix, p)

    def attention(self, parts: PromptParts, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Attention weights from the final tokens onto context[start:end]: [L, heads, Q, C]."""
        cache = self.read_window(parts.prefix, parts.context[start:end])
        return self.query(cache, parts.suffix, len(parts.prefix))

    def reduce(self, a: torch.Tensor) -> torch.Tensor:
        """Attention [L, heads, Q, C] (L = the hooked layers) -> token scores [C]."""
        if self.cfg.heads:
            # Chosen (retrieval) heads: mean over queries per head, then the reduction over heads.
            row = {layer: j for j, layer in enumerate(self.layers)}
            picked = torch.stack([a[row[layer], head] for layer, head in self.cfg.heads])
            return _reduce(_reduce(picked, self.cfg.query_reduce, 1), self.cfg.head_reduce, 0)
        a = _reduce(a, self.cfg.layer_reduce, 0)
        a = _reduce(a, self.cfg.head_reduce, 0)
        return _reduce(a, self.cfg.query_reduce, 0)

    # ----- whole documents ----------------------------------------------------------------
    def reading_key(self, parts: PromptParts) -> str:
        c = self.cfg
        tag = f"{self.identity}|{self.depth}|{c.window}|{c.quantize}|{c.lookahead}"
        return content_key(tag, parts.prefix, parts.context)

    def has_read(self, parts: PromptParts, units: Sequence[Chunk] = ()) -> bool:
        """Whether the document cache holds this document's reading."""
        return self.cache is not None and self.reading_key(parts) in self.cache

    @property
    def workers(self) -> int:
        """Windows read at once (:func:`compression.reading.reader_workers`)."""
        return reader_workers(self.model.device, self.cfg.workers)

    def read(self, parts: PromptParts) -> DocumentReading:
        """The document pass over the whole context (windowed), from the cache when it holds it."""
        key = self.reading_key(parts)
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            return hit
        size = _window_size(self.model, parts, self._extra, self.cfg.window)
        spans = [(s, e) for s, e in windows(len(parts.context), size) if e > s]
        caches = parallel_map(
            lambda span: self.read_window(parts.prefix, parts.context[span[0] : span[1]]),
            spans,
            self.workers,
        )
        wins = tuple(WindowCache(s, e, c) for (s, e), c in zip(spans, caches, strict=True))
        reading = DocumentReading(key, tuple(parts.prefix), tuple(parts.context), wins)
        reading = reading.with_drafter_cache(self.full_depth)
        if self.cache is not None:
            self.cache.put(reading)
        return reading

    @property
    def _extra(self) -> int:
        """Positions of the look-ahead block after the query."""
        return self.model.block_size - 1 if self.cfg.lookahead else 0

    def score(self, parts: PromptParts, units: Sequence[Chunk] = ()) -> torch.Tensor:
        reading = self.read(parts)
        longest = max((w.end - w.start for w in reading.windows), default=0)
        _check_query_fits(self.model, parts, longest, self._extra)
        p = len(parts.prefix)
        # Adapters gate rows through state on the module: query passes that feed mask slots
        # (the look-ahead block) through an adapter drafter must run one at a time.
        gated = self.cfg.lookahead and getattr(self.model, "adapters", None) is not None
        with self.query_mode() as capture:
            out = parallel_map(
                lambda w: self.reduce(self._query(capture, w.cache, parts.suffix, p)),
                reading.windows,
                1 if gated else self.workers,
            )
        scores = torch.cat(out) if out else torch.zeros(0)
        return smooth(scores, self.cfg.smooth_kernel)


class DrafterPerplexityScorer:
    """Self-information of each context token under the drafter (LLMLingua-style)."""

    name = "drafter-ppl"
    token_level = False

    def __init__(self, model: D3DDrafter, window: int | None = None):
        self.model = model
        self.window = window
        self.head_rows = 1024

    @classmethod
    def from_target(cls, target: PreTrainedModel, layers: int | None = None):
        return cls(scoring_model(target, layers))

    @torch.inference_mode()
    def _self_information(self, parts: PromptParts, start: int, end: int) -> torch.Tensor:
        lm, dev = self.model.lm, self.model.device
        ctx = list(parts.context[start:end])
        ids = torch.tensor([[*parts.prefix, *ctx]], device=dev)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        hidden = self.model.body(lm.get_input_embeddings()(ids), pos, None, None)[0]  # [S, H]
        p = len(parts.prefix)
        # Hidden state i predicts token i+1; the first context token is predicted from the prefix
        # (or gets the mean score when there is no prefix).
        first = max(p - 1, 0)
        h = hidden[first : p + len(ctx) - 1]
        targets = ids[0, first + 1 : p + len(ctx)]
        head = lm.get_output_embeddings()
        info = []
        for r in range(0, h.shape[0], self.head_rows):
            logp = torch.log_softmax(head(h[r : r + self.head_rows]).float(), dim=-1)
            info.append(-logp.gather(1, targets[r : r + self.head_rows, None])[:, 0])
        out = torch.cat(info) if info else torch.zeros(0)
        if p == 0 and len(ctx):
            out = torch.cat([out.mean().reshape(1) if out.numel() else torch.zeros(1), out])
        return out

    def score(self, parts: PromptParts, units: Sequence[Chunk] = ()) -> torch.Tensor:
        # No query follows a window here: the prefix and the document fill the limit.
        size = (self.window or _positions(self.model)) - len(parts.prefix)
        out = [
            self._self_information(parts, s, e)
            for s, e in windows(len(parts.context), size)
            if e > s
        ]
        return torch.cat(out) if out else torch.zeros(0)
