"""How each route's input becomes prompt ids, as functions the engine worker runs.

Routes never tokenise: they hand the worker a ``prepare(models) -> Prepared`` closure built
here, which runs on the worker's thread (the only thread that touches the models and the
tokenizer used for encoding). Errors raised here are answers for the client: 413 for an oversized
document, 422 naming the field for a value the library refuses, 400 otherwise.

A chat's head, the tokens every chat with the same system turn starts with (the system message,
or the one the template writes when there is none, and the next turn's opening), is marked as
shared (``Prepared.head``): the engine reads it once into its prefix cache and later chats copy
it. Each chat reads its head on its own, cached or not, so an answer is the same whatever else
is served. The head is found by rendering the system turn with two different user turns and
taking the ids they share (once per system turn), then as much of it as the chat's own ids
begin with; a head under :data:`HEAD_MIN` tokens is not marked (not worth a step of its own).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Mapping, Sequence

from app import documents
from app.engines.jobs import Models
from app.errors import ApiError
from app.prepared import Prepared, PromptBuilder
from d3d.model.load import TemplateVarsError, encode_messages, has_chat_template
from d3d.model.session import common_prefix

HEAD_MIN = 16  # a shorter chat head is read with the rest of its prompt
HEADS_KEPT = 64  # system turns whose head ids are remembered, per tokenizer

_heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
                head = head_length(tok, msgs, ids, template_vars)
            except TemplateVarsError as exc:
                raise ApiError(422, str(exc), "chat_template_kwargs") from exc
        else:
            ids = tok("\n".join(m["content"] for m in msgs), add_special_tokens=True)["input_ids"]
            head = 0
        return Prepared([int(i) for i in ids], head=head)

    return prepare


def head_length(
    tok,
    messages: Sequence[Mapping[str, str]],
    ids: Sequence[int],
    template_vars: Mapping[str, object] | None = None,
) -> int:
    """How many of a chat's ``ids`` (``messages`` through the template) are its head: 0 where
    that is under :data:`HEAD_MIN` tokens (see the module docstring)."""
    n = common_prefix(chat_head(tok, messages, template_vars), ids)
    return n if n >= HEAD_MIN else 0


def chat_head(
    tok, messages: Sequence[Mapping[str, str]], template_vars: Mapping[str, object] | None = None
) -> list[int]:
    """The ids that two chats opening with ``messages``' system turn and different user turns
    share; remembered per tokenizer and system turn."""
    lead = []
    for m in messages:
        if m["role"] != "system":
            break
        lead.append(dict(m))
    key = json.dumps([lead, template_vars or {}], sort_keys=True, default=repr)
    known = _heads.setdefault(tok, {})
    if key not in known:
        a, b = (
            encode_messages(tok, [*lead, {"role": "user", "content": c}], **(template_vars or {}))
            for c in ("a", "b")
        )
        if len(known) >= HEADS_KEPT:
            known.clear()
        known[key] = a[: common_prefix(a, b)]
    return known[key]


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
    ratio = documents.DEFAULT_KEEP_RATIO if keep_ratio is None else keep_ratio
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
