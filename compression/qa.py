"""Document question answering: compress the document, then answer with the engine.

:class:`DocumentQA` is the one object ``d3d qa``, the LongBench sweep and the web service hold:
a :class:`~compression.document_reader.DocumentReader` (each compressor built once, the document
cache, so a second question about the same document skips the reader's document pass) with an
engine that answers. The document is the
context of a prompt template, the question its ``{input}``; the compressor keeps ``keep_ratio``
of the document's tokens, instruction and question whole; the target then answers from the kept
prompt with the engine's decoding mode (lossless).

Timings (:class:`Timings`) are per stage, and ``total_s`` has one definition everywhere: the
sum of tokenising, compressing (segmentation, scoring, selection), the target's prefill and
decoding, with models already loaded. The reader's lock serialises requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from compression.compressor import ATTENTION_SCORERS, Compressed, CompressionConfig
from compression.doc_cache import DocumentCache
from compression.document_reader import QA_TEMPLATE, DocumentReader
from compression.prompt import PromptParts
from d3d.config import DecodeConfig
from d3d.decoding.stats import DecodeStats
from d3d.engine import Engine, Generation

log = logging.getLogger(__name__)


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


class DocumentQA(DocumentReader):
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
        super().__init__(
            engine.drafter,
            engine.target.model,
            target_spec or engine.target.spec,
            tokenizer if tokenizer is not None else engine.tokenizer,
            cfg,
            cache,
            template,
        )

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
        super().forget()
        self.engine.prefix_cache.clear()

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
