"""The ``drafter`` scorer: how well each unit of the document lets the drafter read the question.

LongLLMLingua's coarse step, read by the D3D drafter alone (no word matching inside): with
``l_t(u) = log p(q_t | u, "Question:", q_<t)`` the log-likelihood of the question's token t
after unit u, a unit scores

    s(u) = sum_t max(0, l_t(u) - median_v l_t(v)),

how much it raises the question's tokens above what a typical unit of the document does
(:func:`compression.scorers.contrast`). That rises when u is about what the question asks even
where the two share no word (a paraphrased question, a synonym, an entity named differently);
the contrast keeps tokens every unit predicts alike (the question's grammar, words the question
itself makes likely) from drowning the few a unit really supports. Against the plain mean
log-likelihood, evidence kept on the recall sets at keep 0.1 / 0.05 (of 12 messy + 24 nq30 + 16
offline + 13 LongBench items): 60 / 56 against 58 / 56 (LongBench 7 -> 8 at both, offline 15 ->
16 at 0.1, nq30 22 -> 21 at 0.05; docs/scorers.md). Every unit is read on its own, so the score
is the unit's, not its neighbours'.

Two passes, so a document's reading is shared between its questions (:mod:`compression.doc_cache`):

1. *Unit pass* (per document): the units, a group of up to ``group`` units at a time, as one
   batch of rows ``[pad.., unit]`` (left padding) through every layer of the drafter into a
   batched KV cache. A group is one :class:`~compression.doc_cache.WindowCache` of a
   :class:`~compression.doc_cache.DocumentReading`; groups are read side by side on the cores,
   one torch thread each, as the attention scorer's windows are.
2. *Question pass* (per question): ``lead + question`` appended to every row of a group at once,
   a 4D mask hiding each row's padding; the LM head runs on the question's positions only; the
   question's KV is cut off again, so the reading serves the next question.

Every forward goes through :meth:`D3DDrafter.body` with no mask slots: an adapter drafter then
computes exactly its frozen target layers. The score needs the drafter's whole depth (a shallow
exit through the LM head ranks at chance: docs/longbench.md), so its cost is the drafter's
prefill of the document's tokens plus the question once per unit: cheap where the drafter is
small next to the target (a GPU deployment), about one target prefill where the drafter is the
target's own layers (the embedded pair on this CPU).

Letters: G units in a group, L longest unit, Q lead + question tokens, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from compression.doc_cache import DocumentCache, DocumentReading, WindowCache, content_key
from compression.prompt import PromptParts, Tokenizer, encode_text
from compression.reader_model import quantized_copy, weights_id
from compression.reading import parallel_map, reader_workers
from compression.scorers import contrast
from compression.selection import spread
from compression.units import Chunk, fixed_chunks
from d3d.backends.hf import trim_cache
from d3d.model import masks
from d3d.model.drafter import D3DDrafter

LEAD = "\n\nQuestion:"  # the question's ids start with their space
SUFFIX_TAIL = 64  # question tokens taken from the suffix's end when the parts carry no question


class DrafterQuestionScorer:
    """Question log-likelihood per unit under the drafter (see the module docstring)."""

    name = "drafter"
    token_level = False

    def __init__(
        self,
        drafter: D3DDrafter,
        tokenizer: Tokenizer,
        group: int = 64,
        quantize: bool = False,
        workers: int | None = None,
    ):
        if group < 1:
            raise ValueError(f"unit group must be >= 1, got {group}")
        self.model = quantized_copy(drafter) if quantize else drafter
        self.lead = tuple(encode_text(tokenizer, LEAD))
        self.group = group
        self.requested_workers = workers
        weights = weights_id(drafter.lm.model.layers, drafter.mask_embedding, None)
        self.identity = f"question|{weights}|{quantize}"
        self.cache: DocumentCache | None = None
        self._last: tuple[str, tuple[int, ...], torch.Tensor] | None = None  # the last answer

    @property
    def workers(self) -> int:
        return reader_workers(self.model.device, self.requested_workers)

    # ----- the unit pass ------------------------------------------------------------------
    def reading_key(self, parts: PromptParts, units: Sequence[Chunk]) -> str:
        bounds = [b for u in units for b in (u.start, u.end)]
        return content_key(f"{self.identity}|{self.group}", parts.context, bounds)

    def has_read(self, parts: PromptParts, units: Sequence[Chunk]) -> bool:
        """Whether the document cache holds this document's reading in these units."""
        return self.cache is not None and self.reading_key(parts, units) in self.cache

    @torch.inference_mode()
    def read_group(self, context: Sequence[int], units: Sequence[Chunk]) -> DynamicCache:
        """Rows ``[pad.., unit]`` through the drafter into a batched cache [G, heads, L, d]."""
        dev, width = self.model.device, max(len(u) for u in units)
        ids = torch.zeros(len(units), width, dtype=torch.long)
        for r, u in enumerate(units):
            ids[r, width - len(u) :] = torch.tensor(context[u.start : u.end])
        mask, pos = self._padding(units, width, 0)
        cache = DynamicCache()
        emb = self.model.lm.get_input_embeddings()(ids.to(dev))
        self.model.body(
            emb, pos.to(dev), masks.to_model_mask(mask.to(dev), "eager", emb.dtype), cache
        )
        return cache

    @staticmethod
    def _padding(units: Sequence[Chunk], width: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bool mask [G, 1, width + q (queries, or width), width + q] and positions [G, rows].

        Row r's unit sits at the row's end (left padding); its real tokens and the ``q``
        appended query tokens attend causally to each other and never to the padding, whose
        own rows see themselves only (no empty softmax)."""
        total = width + q
        lengths = torch.tensor([len(u) for u in units])
        pad = width - lengths  # [G]
        col = torch.arange(total)
        causal = col[None, :] <= col[:, None]  # [T, T]
        real = col[None, :] >= pad[:, None]  # [G, T]
        mask = causal[None] & real[:, None, :]
        eye = torch.eye(total, dtype=torch.bool)[None] & ~real[:, :, None]
        mask = mask | eye
        pos = (col[None, :] - pad[:, None]).clamp(min=0)
        if q:  # only the query rows
            mask, pos = mask[:, width:], pos[:, width:]
        return mask[:, None], pos

    def _groups(self, units: Sequence[Chunk]) -> list[tuple[Chunk, ...]]:
        return [tuple(units[i : i + self.group]) for i in range(0, len(units), self.group)]

    def read(
        self, parts: PromptParts, units: Sequence[Chunk], key: str | None = None
    ) -> DocumentReading:
        """The unit pass over the document, from the cache when it holds it (``key``: its
        :meth:`reading_key`, when the caller has it already)."""
        key = key or self.reading_key(parts, units)
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            return hit
        groups = self._groups(units)
        caches = parallel_map(lambda g: self.read_group(parts.context, g), groups, self.workers)
        wins = tuple(
            WindowCache(g[0].start, g[-1].end, c) for g, c in zip(groups, caches, strict=True)
        )
        reading = DocumentReading(key, (), tuple(parts.context), wins)
        if self.cache is not None:
            self.cache.put(reading)
        return reading

    # ----- the question pass ------------------------------------------------------------------
    def question_ids(self, parts: PromptParts) -> tuple[int, ...]:
        return parts.question or parts.suffix[-SUFFIX_TAIL:]

    @torch.inference_mode()
    def ask(
        self, cache: DynamicCache, units: Sequence[Chunk], question: Sequence[int]
    ) -> torch.Tensor:
        """Log-likelihood of each token of ``question`` after each unit of a group: [G, Q]."""
        dev = self.model.device
        width = int(cache.get_seq_length())
        ids = torch.tensor([*self.lead, *question], device=dev)
        q, g = ids.numel(), len(units)
        mask, pos = self._padding(units, width, q)
        emb = self.model.lm.get_input_embeddings()(ids).unsqueeze(0).expand(g, -1, -1)
        try:
            hidden = self.model.body(
                emb, pos.to(dev), masks.to_model_mask(mask.to(dev), "eager", emb.dtype), cache
            )
        finally:
            trim_cache(cache, q)  # the question's KV off again: the reading is intact
        start = len(self.lead) - 1  # hidden state t predicts token t + 1
        h = hidden[:, start : q - 1]
        logp = torch.log_softmax(self.model.lm.get_output_embeddings()(h).float(), dim=-1)
        target = ids[len(self.lead) :].view(1, -1, 1).expand(g, -1, 1)
        return logp.gather(-1, target)[..., 0].cpu()

    def unit_scores(self, parts: PromptParts, units: Sequence[Chunk]) -> torch.Tensor:
        """One score per unit: [C] (the module docstring's contrast)."""
        if not units:
            return torch.zeros(0)
        return contrast(self.token_logprobs(parts, units))

    def token_logprobs(self, parts: PromptParts, units: Sequence[Chunk]) -> torch.Tensor:
        """Each question token's log-likelihood after each unit: [C, Q]."""
        question = tuple(self.question_ids(parts))
        key = self.reading_key(parts, units)
        cached = self.cache is None or key in self.cache  # an emptied cache reads afresh
        if cached and self._last is not None and self._last[:2] == (key, question):
            return self._last[2].clone()  # the same question again (another scorer, another keep)
        reading = self.read(parts, units, key)
        groups = self._groups(units)
        out = parallel_map(
            lambda pair: self.ask(pair[0].cache, pair[1], question),
            list(zip(reading.windows, groups, strict=True)),
            self.workers,
        )
        logprobs = torch.cat(out)
        self._last = (key, question, logprobs)
        return logprobs.clone()

    def score(self, parts: PromptParts, units: Sequence[Chunk] | None = None) -> torch.Tensor:
        units = units if units is not None else fixed_chunks(len(parts.context), 32)
        return spread(self.unit_scores(parts, units), units)
