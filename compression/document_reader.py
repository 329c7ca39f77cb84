"""A document read for a question: the compressors and the document cache, without an engine.

:class:`DocumentReader` holds what reading needs and nothing that answers: the drafter (which
scores), the target's model where a scorer reads with the target's first layers or weighs the
reading's cost against the target's prefill (a skeleton of shapes on the meta device does for
the cost), the tokenizer and the QA template, each compressor built once (every drafter-reading
scorer shares one attention reader) and the :class:`~compression.doc_cache.DocumentCache`, so a
second question about the same document skips the reader's document pass.

:class:`~compression.qa.DocumentQA` is a reader with an engine that answers. The service's
drafter worker (``app.documents.WorkerReader``) holds a reader alone: beside vLLM the drafter
exists once, in that worker, and reads there. A lock serialises readings: the attention
reader's query pass switches the reader's attention implementation and every reading writes to
the shared document cache.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import replace

from transformers import PreTrainedModel

from compression.compressor import (
    ATTENTION_SCORERS,
    DRAFTER_SCORERS,
    QUESTION_SCORERS,
    Compressed,
    CompressionConfig,
    Compressor,
)
from compression.doc_cache import DocumentCache
from compression.drafter_scorers import DrafterAttentionScorer
from compression.presets import attention_preset, make_attention_scorer, resolve_scorer
from compression.prompt import PromptParts, build_parts
from compression.question_scorer import DrafterQuestionScorer
from d3d.model.drafter import D3DDrafter

QA_TEMPLATE = (
    "Read the document below and answer the question that follows.\n\n{context}\n\n"
    "Answer the question based on the document above. Only give me the answer and do not "
    "output any other words.\n\nQuestion: {input}\nAnswer:"
)


class DocumentReader:
    """Compressors for one drafter and target, and the document cache (see the module
    docstring). ``cfg.attention=None`` takes the measured preset for the target and drafter."""

    def __init__(
        self,
        drafter: D3DDrafter | None,
        target: PreTrainedModel | None,
        target_spec: str,
        tokenizer,
        cfg: CompressionConfig | None = None,
        cache: DocumentCache | None = None,
        template: str = QA_TEMPLATE,
    ):
        self.drafter, self.target_model, self.tokenizer = drafter, target, tokenizer
        cfg = cfg or CompressionConfig()
        if cfg.attention is None:
            cfg = replace(cfg, attention=attention_preset(target_spec, drafter))
        self.cfg = cfg
        self.cache = cache if cache is not None else DocumentCache()
        self.template = template
        self._attention: DrafterAttentionScorer | None = None
        self._question: DrafterQuestionScorer | None = None
        self._compressors: dict[str, Compressor] = {}
        self.lock = threading.RLock()

    def attention(self) -> DrafterAttentionScorer:
        """The one attention reader (built on first use), wired to the document cache."""
        if self._attention is None:
            att = self.cfg.attention
            if att is not None and att.reader == "target" and not _has_layers(self.target_model):
                raise ValueError(
                    "the attention scorers read with the target's first layers here, which this "
                    "process does not hold: choose another scorer (auto, drafter, drafter-match, "
                    "bm25)"
                )
            att = make_attention_scorer(att, self.drafter, self.target_model)  # type: ignore[arg-type]
            att.cache = self.cache
            self._attention = att
        return self._attention

    def question(self) -> DrafterQuestionScorer:
        """The one question-likelihood reader (built on first use), wired to the document cache."""
        if self._question is None:
            self._question = DrafterQuestionScorer(
                self.drafter,  # type: ignore[arg-type]
                self.tokenizer,
                quantize=self.cfg.question_int8,
            )
            self._question.cache = self.cache
        return self._question

    def resolve(self, scorer: str | None = None) -> str:
        """The scorer a name stands for here (``auto`` picks by reading cost)."""
        return resolve_scorer(scorer or self.cfg.scorer, self.drafter, self.target_model)

    def compressor(self, scorer: str | None = None) -> Compressor:
        """The compressor for ``scorer`` (default: the configured one), built once."""
        name = self.resolve(scorer)
        if name not in self._compressors:
            cfg = replace(self.cfg, scorer=name)
            if name in DRAFTER_SCORERS and self.drafter is None:
                raise ValueError(f"scorer {name!r} needs a drafter")
            att = self.attention() if name in ATTENTION_SCORERS else None
            question = self.question() if name in QUESTION_SCORERS else None
            self._compressors[name] = Compressor.build(
                cfg, self.tokenizer, self.drafter, self.target_model, att, question
            )
        return self._compressors[name]

    def parts(
        self,
        document: str,
        question: str,
        template: str | None = None,
        chat_template: bool = True,
        template_vars: Mapping[str, object] | None = None,
    ) -> PromptParts:
        """The QA prompt's parts; ``template_vars`` reach the chat template (non-thinking
        unless they set ``enable_thinking``)."""
        if not document.strip():
            raise ValueError("the document is empty")
        if not question.strip():
            raise ValueError("the question is empty")
        return build_parts(
            self.tokenizer,
            template or self.template,
            document,
            chat_template=chat_template,
            template_vars=template_vars,
            input=question,
        )

    def prompt_text(self, result) -> str:
        """The exact prompt the target read for ``result`` (a
        :class:`~compression.qa.QAResult`: the kept prompt, special tokens and the chat
        template's think block included)."""
        return self.tokenizer.decode(list(result.compression.parts.ids), skip_special_tokens=False)

    def is_cached(self, parts: PromptParts, scorer: str | None = None) -> bool:
        """Whether the reader's pass over this document is in the cache."""
        return self.compressor(scorer).has_read(parts)

    def compress(
        self, parts: PromptParts, keep_ratio: float | None = None, scorer: str | None = None
    ) -> Compressed:
        with self.lock:
            return self.compressor(scorer).compress(parts, keep_ratio)

    def forget(self) -> None:
        """Empty the document cache (both tiers)."""
        self.cache.clear()
        self.cache.clear_disk()


def _has_layers(model: PreTrainedModel | None) -> bool:
    """Whether ``model``'s decoder layers hold weights (not a skeleton on the meta device)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    first = next(layers[0].parameters(), None)
    return first is not None and not first.is_meta
