"""How each route's input becomes prompt ids, as functions the engine worker runs.

Routes never tokenise: they hand the worker a ``prepare(models) -> Prepared`` closure built
here, which runs on the worker's thread (the only thread that touches the models and the
tokenizer used for encoding). Errors raised here are answers for the client: 413 for an oversized
document, 422 naming the field for a value the library refuses, 400 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from app import documents
from app.errors import ApiError
from app.prepared import Prepared, PromptBuilder
from app.worker import Models
from d3d.model.load import TemplateVarsError, encode_messages, has_chat_template

DEFAULT_KEEP_RATIO = 0.3


def chat(
    messages: Sequence[tuple[str, str]], template_vars: Mapping[str, object] | None = None
) -> Callable[[Models], Prepared]:
    """Chat messages ``(role, text)`` through the tokenizer's chat template (non-thinking unless
    ``template_vars``, the request's ``chat_template_kwargs``, say ``enable_thinking``)."""

    def prepare(models: Models) -> Prepared:
        tok = models.engine.tokenizer
        msgs = [{"role": "system" if r == "developer" else r, "content": t} for r, t in messages]
        if has_chat_template(tok):
            try:
                ids = encode_messages(tok, msgs, **(template_vars or {}))
            except TemplateVarsError as exc:
                raise ApiError(422, str(exc), "chat_template_kwargs") from exc
        else:
            ids = tok("\n".join(m["content"] for m in msgs), add_special_tokens=True)["input_ids"]
        return Prepared([int(i) for i in ids])

    return prepare


def text(prompt: str) -> Callable[[Models], Prepared]:
    """A raw completion prompt (no chat template)."""

    def prepare(models: Models) -> Prepared:
        return Prepared(models.engine.encode(prompt, chat_template=False))

    return prepare


def qa(
    document: str,
    question: str,
    keep_ratio: float | None,
    scorer: str | None,
    max_document_tokens: int,
    return_prompt: bool = False,
    template_vars: Mapping[str, object] | None = None,
) -> PromptBuilder:
    """A document compressed for a question, in the QA prompt (see :mod:`app.documents`); it
    runs on the worker's reader thread.

    ``return_prompt``: ``info["prompt"]`` is the exact text the target reads (its prompt ids
    decoded, special tokens and the chat template's think block included)."""
    ratio = DEFAULT_KEEP_RATIO if keep_ratio is None else keep_ratio
    name = scorer or documents.DEFAULT_SCORER

    def prepare(models: Models) -> Prepared:
        try:
            doc = models.documents.prepare(
                document, question, ratio, name, max_document_tokens, template_vars
            )
        except documents.DocumentTooLarge as exc:
            raise ApiError(413, str(exc), "document") from exc
        except TemplateVarsError as exc:
            raise ApiError(422, str(exc), "chat_template_kwargs") from exc
        except ValueError as exc:
            msg = str(exc)
            param = "scorer" if "scorer" in msg else "document" if "document" in msg else None
            raise ApiError(422 if param else 400, msg, param) from exc
        if return_prompt:  # the reader thread's own tokenizer
            tok = models.documents.tokenizer
            doc.info["prompt"] = tok.decode(doc.prompt_ids, skip_special_tokens=False)
        return doc

    return PromptBuilder(prepare, reads_document=True)
