"""The app's one door into ``compression/``: documents in, a compressed prompt and its spans out.

Every call from the service into the compression package goes through this module, so a change
of that package's API is one edit here. :class:`Documents` holds one
:class:`compression.qa.DocumentQA` per engine (compressors built once, the document cache shared
by every request) and runs on the engine worker's reader thread only, with a tokenizer of its own
(its scorers run an int8 copy of the target's first layers or the drafter, never the target's
own modules, so the engine thread decodes meanwhile).

Kept spans are character offsets into the document: the document is tokenised once more with
offsets (the same call compression makes, plus ``return_offsets_mapping``), and the kept runs
(``Compressed.spans``: the pieces of the kept prompt between its gap markers) become
``[start, end)`` ranges.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence

from app.prepared import Prepared
from compression.compressor import DEFAULT_SCORER, SCORERS
from compression.doc_cache import DocumentCache
from compression.qa import DocumentQA

__all__ = ["DEFAULT_SCORER", "DocumentTooLarge", "Documents", "scorers"]


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
    """Document QA prompts for one engine (see the module docstring)."""

    def __init__(self, engine, cache_dir: str | None = None, max_disk_bytes: int = 8 << 30):
        self.engine = engine
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # used from the reader thread only
        cache = (
            DocumentCache(directory=cache_dir, max_disk_bytes=max_disk_bytes) if cache_dir else None
        )
        self.qa = DocumentQA(engine, cache=cache, tokenizer=self.tokenizer)

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
        parts = self.qa.parts(document, question, template_vars=template_vars)
        comp = self.qa.compress(parts, keep_ratio, scorer)
        info = comp.to_dict()
        # Spans need compression's tokens to be the offset tokens (true when it tokenises the
        # document alone, as today); otherwise the page shows no highlight rather than a wrong one.
        info["kept_spans"] = (
            kept_spans(offsets, comp.spans) if comp.context_tokens == len(offsets) else []
        )
        info["document_chars"] = len(document)
        shared = comp.shared_prefix if comp.head else 0
        return Prepared(comp.parts.ids, info, time.perf_counter() - t0, shared)
