"""Document question answering: compress the document, then answer with the engine.

:class:`DocumentQA` is the one object ``d3d qa``, the LongBench sweep and the web service hold:
it owns an engine, builds each compressor once (every drafter-reading scorer shares one
attention reader) and owns the :class:`~compression.doc_cache.DocumentCache`, so a second
question about the same document skips the reader's document pass. The document is the
context of a prompt template, the question its ``{input}``; the compressor keeps ``keep_ratio``
of the document's tokens, instruction and question whole; the target then answers from the kept
prompt with the engine's decoding mode (lossless).

Timings (:class:`Timings`) are per stage, and ``total_s`` has one definition everywhere: the
sum of tokenising, compressing (segmentation, scoring, selection), the target's prefill and
decoding, with models already loaded. A lock serialises requests: the reader's query pass
switches the reader's attention implementation and writes to a shared document cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

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
from d3d.config import DecodeConfig
from d3d.decoding.stats import DecodeStats
from d3d.engine import Engine, Generation

log = logging.getLogger(__name__)

QA_TEMPLATE = (
    "Read the document below and answer the question that follows.\n\n{context}\n\n"
    "Answer the question based on the document above. Only give me the answer and do not "
    "output any other words.\n\nQuestion: {input}\nAnswer:"
)


@dataclass(frozen=True)
class Timings:
    """Seconds per stage of one answer; ``total_s`` is their sum (see the module docstring)."""

    tokenize_s: float = 0.0
    compress_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.tokenize_s + self.compress_s + self.prefill_s + self.decode_s

    def to_dict(self) -> dict:
        out = {k: round(v, 4) for k, v in asdict(self).items()}
        out["total_s"] = round(self.total_s, 4)
        return out


@dataclass(frozen=True)
class QAResult:
    """An answer, what compression kept, the decode statistics and the stage timings."""

    answer: str
    question: str
    compression: Compressed
    speculative: dict
    timings: Timings
    cached: bool = False

    def to_dict(self) -> dict:
        comp = self.compression.to_dict()
        comp["document_cached"] = self.cached
        return {
            "question": self.question,
            "answer": self.answer,
            "compression": comp,
            "speculative": self.speculative,
            "timings": self.timings.to_dict(),
        }


class DocumentQA:
    """An engine, its compressors (built once) and the document cache; see the module docstring.

    ``cfg`` gives the default scorer, keep ratio and segmentation; ``cfg.attention=None`` takes
    the measured preset for the engine's target and drafter.
    """

    def __init__(
        self,
        engine: Engine,
        cfg: CompressionConfig | None = None,
        cache: DocumentCache | None = None,
        template: str = QA_TEMPLATE,
        target_spec: str | None = None,
        tokenizer=None,
    ):
        """``tokenizer``: one of its own (a thread other than the engine's reads documents);
        default the engine's."""
        self.engine = engine
        self._tokenizer = tokenizer
        cfg = cfg or CompressionConfig()
        if cfg.attention is None:
            spec = target_spec or engine.target.spec
            cfg = replace(cfg, attention=attention_preset(spec, engine.drafter))
        self.cfg = cfg
        self.cache = cache if cache is not None else DocumentCache()
        self.template = template
        self._attention: DrafterAttentionScorer | None = None
        self._question: DrafterQuestionScorer | None = None
        self._compressors: dict[str, Compressor] = {}
        self.lock = threading.RLock()

    @property
    def tokenizer(self):
        return self._tokenizer if self._tokenizer is not None else self.engine.tokenizer

    def attention(self) -> DrafterAttentionScorer:
        """The one attention reader (built on first use), wired to the document cache."""
        if self._attention is None:
            att = make_attention_scorer(
                self.cfg.attention, self.engine.drafter, self.engine.target.model
            )
            att.cache = self.cache
            self._attention = att
        return self._attention

    def question(self) -> DrafterQuestionScorer:
        """The one question-likelihood reader (built on first use), wired to the document cache."""
        if self._question is None:
            self._question = DrafterQuestionScorer(
                self.engine.drafter, self.tokenizer, quantize=self.cfg.question_int8
            )
            self._question.cache = self.cache
        return self._question

    def resolve(self, scorer: str | None = None) -> str:
        """The scorer a name stands for with this engine (``auto`` picks by reading cost)."""
        return resolve_scorer(
            scorer or self.cfg.scorer, self.engine.drafter, self.engine.target.model
        )

    def compressor(self, scorer: str | None = None) -> Compressor:
        """The compressor for ``scorer`` (default: the configured one), built once."""
        name = self.resolve(scorer)
        if name not in self._compressors:
            cfg = replace(self.cfg, scorer=name)
            if name in DRAFTER_SCORERS and self.engine.drafter is None:
                raise ValueError(f"scorer {name!r} needs a drafter")
            att = self.attention() if name in ATTENTION_SCORERS else None
            question = self.question() if name in QUESTION_SCORERS else None
            self._compressors[name] = Compressor.build(
                cfg, self.tokenizer, self.engine.drafter, self.engine.target.model, att, question
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

    def prompt_text(self, result: QAResult) -> str:
        """The exact prompt the target read for ``result`` (the kept prompt, special tokens and
        the chat template's think block included)."""
        return self.tokenizer.decode(list(result.compression.parts.ids), skip_special_tokens=False)

    def overlap(self, scorer: str | None = None) -> bool:
        """Whether the target may encode the document's head while ``scorer`` reads: always,
        unless the reader runs the target's own layer modules (the query pass switches their
        attention implementation, which the target's forward must not see)."""
        name = self.resolve(scorer)
        if name not in ATTENTION_SCORERS:
            return True
        reader = {id(p) for p in self.attention().model.lm.model.layers.parameters()}
        return not any(id(p) in reader for p in self.engine.target.model.parameters())

    def _cache_prefix(self, ids: list[int]) -> None:
        try:
            self.engine.cache_prefix(ids)
        except Exception:  # the request then encodes the head itself
            log.exception("encoding the document head ahead of the answer failed")

    def forget(self) -> None:
        """Empty the document cache (both tiers) and the target's prefix cache (a cold first
        question)."""
        self.cache.clear()
        self.cache.clear_disk()
        self.engine.prefix_cache.clear()

    def is_cached(self, parts: PromptParts, scorer: str | None = None) -> bool:
        """Whether the reader's pass over this document is in the cache."""
        return self.compressor(scorer).has_read(parts)

    def compress(
        self, parts: PromptParts, keep_ratio: float | None = None, scorer: str | None = None
    ) -> Compressed:
        with self.lock:
            return self.compressor(scorer).compress(parts, keep_ratio)

    def answer_parts(
        self,
        parts: PromptParts,
        dcfg: DecodeConfig,
        keep_ratio: float | None = None,
        scorer: str | None = None,
        tokenize_s: float = 0.0,
        question: str = "",
        draft_from_document: bool = False,
    ) -> QAResult:
        """Compress prepared parts and answer (the sweep's entry point).

        ``draft_from_document``: the drafter reads the whole prompt (full document) while the
        target reads the kept one (speculative modes; the answer is the same, lossless)."""
        with self.lock:
            cached = self.is_cached(parts, scorer)
            warm: list[threading.Thread] = []

            def on_head(n: int) -> None:  # the target reads the head while the reader scores
                if self.overlap(scorer):
                    ids = [*parts.prefix, *parts.context[:n]]
                    warm.append(threading.Thread(target=self._cache_prefix, args=(ids,)))
                    warm[-1].start()

            comp = self.compressor(scorer).compress(parts, keep_ratio, on_head)
            t0 = time.perf_counter()
            for t in warm:
                t.join()
            waited = time.perf_counter() - t0
            # The instruction and the document's head open every question's kept prompt: the
            # target's KV for them is kept for the next question (the engine's prefix cache).
            stats = DecodeStats(mode=dcfg.mode)
            try:  # the engine checks the request at once (window, KV budget): say the fix
                chunks = self.engine.stream(
                    comp.parts.ids,
                    dcfg,
                    stats,
                    draft_prompt_ids=parts.ids if draft_from_document else None,
                    shared_prefix=comp.shared_prefix if comp.head else 0,
                )
            except ValueError as exc:
                raise ValueError(f"the kept prompt does not fit: {exc}; lower --keep") from exc
            ids = [t for chunk in chunks for t in chunk]
            gen = Generation(self.tokenizer.decode(ids, skip_special_tokens=True), ids, stats)
        st = gen.stats
        timings = Timings(tokenize_s, comp.seconds, waited + st.prefill_seconds, st.decode_seconds)
        return QAResult(gen.text.strip(), question, comp, st.to_dict(), timings, cached)

    def answer(
        self,
        document: str,
        question: str,
        dcfg: DecodeConfig,
        keep_ratio: float | None = None,
        scorer: str | None = None,
        template: str | None = None,
        draft_from_document: bool = False,
    ) -> QAResult:
        """Compress ``document`` for ``question``, then answer."""
        t0 = time.perf_counter()
        parts = self.parts(document, question, template, dcfg.chat_template)
        tokenize_s = time.perf_counter() - t0
        return self.answer_parts(
            parts, dcfg, keep_ratio, scorer, tokenize_s, question, draft_from_document
        )

    def answer_all(
        self,
        document: str,
        questions: Sequence[str],
        dcfg: DecodeConfig,
        keep_ratio: float | None = None,
        scorer: str | None = None,
        template: str | None = None,
        draft_from_document: bool = False,
    ) -> list[QAResult]:
        """Several questions about one document (the reader reads it once)."""
        return [
            self.answer(document, q, dcfg, keep_ratio, scorer, template, draft_from_document)
            for q in questions
        ]
