"""Document question answering: compress the document, then answer with the engine.

The library entry point behind ``d3d qa`` (and the web app's ``/qa``): the document is the
context of a prompt template, the question its ``{input}``; the compressor keeps ``keep_ratio``
of the document's tokens, instruction and question whole; the target then answers from the kept
prompt with the engine's decoding mode (speculative ``sync`` by default, lossless). Timings are
per stage and end to end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from compression.compressor import DRAFTER_SCORERS, Compressed, CompressionConfig, Compressor
from compression.prompt import build_parts
from d3d.config import DecodeConfig
from d3d.engine import Engine

QA_TEMPLATE = (
    "Read the document below and answer the question that follows.\n\n{context}\n\n"
    "Answer the question based on the document above. Only give me the answer and do not "
    "output any other words.\n\nQuestion: {input}\nAnswer:"
)


@dataclass(frozen=True)
class QAResult:
    """An answer, what compression kept, the decode statistics and the stage timings."""

    answer: str
    compression: Compressed
    speculative: dict
    timings: dict

    def to_dict(self) -> dict:
        return {
            "answer": self.answer,
            "compression": self.compression.to_dict(),
            "speculative": self.speculative,
            "timings": self.timings,
        }


def compress_document(
    engine: Engine,
    document: str,
    question: str,
    cfg: CompressionConfig,
    template: str = QA_TEMPLATE,
    chat_template: bool = True,
) -> tuple[Compressed, float]:
    """Compress ``document`` for ``question``; returns the result and the tokenising seconds."""
    if not document.strip():
        raise ValueError("the document is empty")
    if not question.strip():
        raise ValueError("the question is empty")
    t0 = time.perf_counter()
    parts = build_parts(
        engine.tokenizer, template, document, chat_template=chat_template, input=question
    )
    tokenize_s = time.perf_counter() - t0
    if cfg.scorer in DRAFTER_SCORERS and engine.drafter is None:
        raise ValueError(f"scorer {cfg.scorer!r} needs a drafter")
    comp = Compressor.build(cfg, engine.tokenizer, engine.drafter, engine.target.model)
    return comp.compress(parts), tokenize_s


def answer_document(
    engine: Engine,
    document: str,
    question: str,
    cfg: CompressionConfig,
    dcfg: DecodeConfig,
    template: str = QA_TEMPLATE,
) -> QAResult:
    """Compress, then answer (see the module docstring)."""
    t0 = time.perf_counter()
    comp, tokenize_s = compress_document(
        engine, document, question, cfg, template, dcfg.chat_template
    )
    window = getattr(engine.target.model.config, "max_position_embeddings", None)
    if window and comp.kept_tokens + dcfg.max_new_tokens + dcfg.block_size > window:
        raise ValueError(
            f"the kept prompt ({comp.kept_tokens} tokens) does not fit the target's "
            f"{window}-token window: lower --keep"
        )
    gen = engine.generate_ids(comp.parts.ids, dcfg)
    st = gen.stats
    timings = {
        "tokenize_s": round(tokenize_s, 4),
        "compress_s": round(comp.seconds, 4),
        "prefill_s": round(st.prefill_seconds, 4),
        "decode_s": round(st.decode_seconds, 4),
        "total_s": round(time.perf_counter() - t0, 4),
    }
    return QAResult(gen.text.strip(), comp, st.to_dict(), timings)
