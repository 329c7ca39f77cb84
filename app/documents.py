"""The app's one door into ``compression/``: documents in, a compressed prompt and its spans out.

Every call from the service into the compression package goes through this module, so a change
of that package's API is one edit here. :class:`Documents` holds one
:class:`compression.document_reader.DocumentReader` (compressors built once, the document cache
shared by every request) with a tokenizer of its own, and runs on one thread at a time:

- on the own engine, the engine worker's reader thread, with the engine's
  :class:`compression.qa.DocumentQA` (its scorers run an int8 copy of the target's first layers
  or the drafter, never the target's own modules, so the engine thread decodes meanwhile);
- beside vLLM, in the drafter worker's process (:class:`WorkerReader`, built there from plain
  fields through :mod:`d3d.worker.reading`): the drafter exists once, on its own device, and the
  API process asks it through :class:`RemoteDocuments`, which holds only a tokenizer; where
  speculation is off there is no drafter anywhere and :meth:`Documents.without_models` reads in
  the API process with what needs no model (``auto`` is BM25 there).

A reading's reply crosses a socket as plain values: :func:`reply` and :func:`prepared_of`.

Kept spans are character offsets into the document: the document is tokenised once more with
offsets (the same call compression makes, plus ``return_offsets_mapping``), and the kept runs
(``Compressed.spans``: the pieces of the kept prompt between its gap markers) become
``[start, end)`` ranges.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.errors import ApiError
from app.prepared import Prepared
from compression.compressor import DEFAULT_SCORER, SCORERS
from compression.doc_cache import DocumentCache
from compression.document_reader import DocumentReader
from compression.selection import DEFAULT_KEEP_RATIO, check_keep_ratio
from d3d.model.load import TemplateVarsError

__all__ = [
    "DEFAULT_KEEP_RATIO",
    "DEFAULT_SCORER",
    "DocumentTooLarge",
    "Documents",
    "RemoteDocuments",
    "WorkerReader",
    "check_keep_ratio",
    "scorers",
]


class DocumentTooLarge(ValueError):
    """The document has more tokens than the service accepts."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the document has {tokens} tokens; the limit is {limit} tokens")
        self.tokens, self.limit = tokens, limit


def scorers() -> tuple[str, ...]:
    return tuple(SCORERS)


def kept_spans(
    offsets: Sequence[tuple[int, int]], runs: Sequence[tuple[int, int]]
) -> list[list[int]]:
    """Kept token runs ``[a, b)`` as character ranges ``[start, end)`` (touching ranges join)."""
    spans: list[list[int]] = []
    for a, b in runs:
        start, end = offsets[a][0], offsets[b - 1][1]
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return spans


class Documents:
    """Document QA prompts from one reader (see the module docstring)."""

    def __init__(self, reader: DocumentReader):
        self.reader = reader
        self.tokenizer = reader.tokenizer  # the reader's own: used from one thread only

    @classmethod
    def for_engine(
        cls, engine, cache_dir: str | None = None, max_disk_bytes: int = 8 << 30
    ) -> Documents:
        """The own engine's: its drafter and target read, with a tokenizer of their own."""
        from compression.qa import DocumentQA

        tok = copy.deepcopy(engine.tokenizer)
        return cls(DocumentQA(engine, cache=_cache(cache_dir, max_disk_bytes), tokenizer=tok))

    @classmethod
    def without_models(
        cls, text, cache_dir: str | None = None, max_disk_bytes: int = 8 << 30
    ) -> Documents:
        """No drafter and no target (speculation off beside vLLM): lexical scorers only.
        ``text``: the target's :class:`~d3d.model.load.TargetText`."""
        tok = copy.deepcopy(text.tokenizer)
        return cls(
            DocumentReader(None, None, text.spec, tok, cache=_cache(cache_dir, max_disk_bytes))
        )

    def prepare(
        self,
        document: str,
        question: str,
        keep_ratio: float,
        scorer: str,
        max_document_tokens: int,
        template_vars: Mapping[str, object] | None = None,
    ) -> Prepared:
        """Compress ``document`` for ``question`` and build the answer prompt (``template_vars``:
        chat-template variables, e.g. a chat request's ``enable_thinking``)."""
        t0 = time.perf_counter()
        enc = self.tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        if len(offsets) > max_document_tokens:
            raise DocumentTooLarge(len(offsets), max_document_tokens)
        parts = self.reader.parts(document, question, template_vars=template_vars)
        comp = self.reader.compress(parts, keep_ratio, scorer)
        info = comp.to_dict()
        # Spans need compression's tokens to be the offset tokens (true when it tokenises the
        # document alone, as today); otherwise the page shows no highlight rather than a wrong one.
        info["kept_spans"] = (
            kept_spans(offsets, comp.spans) if comp.context_tokens == len(offsets) else []
        )
        info["document_chars"] = len(document)
        shared = comp.shared_prefix if comp.head else 0
        return Prepared(comp.parts.ids, info, time.perf_counter() - t0, shared)


def _cache(cache_dir: str | None, max_disk_bytes: int) -> DocumentCache | None:
    return DocumentCache(directory=cache_dir, max_disk_bytes=max_disk_bytes) if cache_dir else None


# ----- reading in the drafter worker ------------------------------------------------------------
def reply(prepare, args: Mapping[str, object]) -> dict:
    """``prepare(**args)`` (a :meth:`Documents.prepare`) as plain values: the prompt, or the
    error a client answers with (``DocumentTooLarge``, ``TemplateVarsError``, ``ValueError``)."""
    try:
        p = prepare(**args)
    except DocumentTooLarge as exc:
        return {"error": "DocumentTooLarge", "tokens": exc.tokens, "limit": exc.limit}
    except TemplateVarsError as exc:
        return {"error": "TemplateVarsError", "message": str(exc)}
    except ValueError as exc:
        return {"error": "ValueError", "message": str(exc)}
    return {
        "prompt_ids": [int(t) for t in p.prompt_ids],
        "info": p.info,
        "seconds": p.seconds,
        "shared_prefix": p.shared_prefix,
    }


def prepared_of(out: Mapping[str, object]) -> Prepared:
    """The :class:`Prepared` a :func:`reply` stands for; its error raised as it was."""
    kind = out.get("error")
    if kind == "DocumentTooLarge":
        raise DocumentTooLarge(int(out["tokens"]), int(out["limit"]))  # type: ignore[arg-type]
    if kind == "TemplateVarsError":
        raise TemplateVarsError(str(out.get("message", "")))
    if kind == "ValueError":
        raise ValueError(str(out.get("message", "")))
    if kind is not None:
        raise RuntimeError(f"reading failed in the drafter worker: {kind}: {out.get('message')}")
    return Prepared(
        [int(t) for t in out["prompt_ids"]],  # type: ignore[union-attr]
        dict(out["info"]),  # type: ignore[arg-type]
        float(out["seconds"]),  # type: ignore[arg-type]
        int(out["shared_prefix"]),  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class WorkerReader:
    """Built in the drafter worker's process from these plain fields
    (:class:`d3d.worker.reading.ReaderSpec`), then called with its drafter: the reader that
    answers :class:`RemoteDocuments` there. The target is a skeleton of shapes (the reading's
    cost is weighed against its prefill); its tokenizer is loaded there."""

    target: str
    cache_dir: str | None = None
    cache_max_bytes: int = 8 << 30

    def __call__(self, drafter):
        import torch

        from d3d.model.load import load_text
        from d3d.model.skeleton import meta_lm

        text = load_text(self.target)
        shape = meta_lm(text.config, torch.float32) if text.config is not None else None
        reader = DocumentReader(
            drafter,
            shape,
            self.target,
            text.tokenizer,
            cache=_cache(self.cache_dir, self.cache_max_bytes),
        )
        docs = Documents(reader)
        return lambda args: reply(docs.prepare, args)


class RemoteDocuments:
    """:class:`Documents` whose reading runs in the drafter worker (:class:`WorkerReader`), asked
    through ``client`` (a :class:`d3d.worker.reading.ReadClient`); ``tokenizer``: the API's own."""

    def __init__(self, client, tokenizer):
        self.client = client
        self.tokenizer = copy.deepcopy(tokenizer)

    def prepare(
        self,
        document: str,
        question: str,
        keep_ratio: float,
        scorer: str,
        max_document_tokens: int,
        template_vars: Mapping[str, object] | None = None,
    ) -> Prepared:
        args = {
            "document": document,
            "question": question,
            "keep_ratio": float(keep_ratio),
            "scorer": scorer,
            "max_document_tokens": int(max_document_tokens),
            "template_vars": dict(template_vars) if template_vars else None,
        }
        try:
            out = self.client.read(args)
        except (ConnectionError, TimeoutError) as exc:  # no worker up to read, or a slow one
            raise ApiError(503, str(exc), kind="server_busy", headers={"Retry-After": "5"}) from exc
        return prepared_of(out)
