"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Shaped so the official OpenAI SDK works unchanged: the same bodies, ``stream=True`` as SSE
chunks ending in ``data: [DONE]``, a final usage chunk with ``stream_options.include_usage``,
``stop`` strings, ``seed``, ``n`` choices, ``logprobs``, and vLLM's sampling fields
(:class:`~app.schemas.VllmSampling`: penalties, ``top_k``, ``min_p``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``), so vLLM's benchmark client runs against it. A stream's
first chunk leaves with the first token (:mod:`app.routes.openai_format`). Extras through ``extra_body``: ``speculative: {mode}``,
``keep_ratio`` / ``scorer`` and ``document``. With a ``document`` (or with ``keep_ratio`` and a
system message, which is then taken as the document), the request is answered like ``/qa``:
the document compressed for the last user message (or the prompt), in the QA template.
Non-streaming responses carry the decode statistics under ``speculative`` (vLLM names).

Every route needs the API key when one is set, checked before the body is read
(:mod:`app.middleware`); a request's caps (``max_tokens``, ``n``, logprobs, stop strings and
ids) are the settings' (:mod:`app.limits`), checked before anything is queued.

Chat prompts are non-thinking by default; ``chat_template_kwargs`` (as vLLM takes them, e.g.
``{"enable_thinking": true}``) reach the chat template. For a model with think tags (Qwen3) the
thinking comes apart from the answer as ``message.reasoning_content`` / streaming
``delta.reasoning_content`` (vLLM's reasoning-parser convention, :mod:`app.reasoning`), and
``content`` never holds a tag.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app import prompts, reasoning
from app.engines.jobs import Job
from app.errors import ApiError, request_id
from app.generation import Run
from app.limits import check_generation, check_max_tokens, check_stops
from app.routes.common import (
    SSE_DONE,
    SSE_HEADERS,
    error_payload,
    figures,
    sampling,
    sse,
    usage,
)
from app.routes.openai_format import Shape
from app.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest

log = logging.getLogger("app.openai")
router = APIRouter(prefix="/v1", tags=["openai"])
DEFAULT_MAX_TOKENS = 256


def check_model(request: Request, name: str) -> None:
    served = request.app.state.model_name
    if name not in (served, "default", request.app.state.settings.model.target):
        raise ApiError(404, f"model {name!r} not found: this server serves {served!r}", "model")


def _document_prepare(
    request: Request, body: OpenAIRequest, question: str, system: str, template_vars=None
):
    """A /qa-style prompt when the request carries a document (see the module docstring)."""
    document = body.document
    if document is None and body.keep_ratio is not None:
        if not system.strip():
            raise ApiError(
                422,
                "keep_ratio needs a document: pass `document` or a system message",
                "keep_ratio",
            )
        document = system
    if document is None:
        if body.scorer is not None:
            raise ApiError(422, "scorer needs a document", "scorer")
        return None
    if not document.strip():
        raise ApiError(422, "document: must not be empty", "document")
    limit = request.app.state.settings.max_document_tokens
    return prompts.qa(
        document, question, body.keep_ratio, body.scorer, limit, template_vars=template_vars
    )


def _logprobs(body: OpenAIRequest, chat: bool) -> int | None:
    """How many alternatives each token's logprob comes with (None: no logprobs)."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(422, "top_logprobs needs logprobs: true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def _check_sampling(
    request: Request, body: OpenAIRequest, max_tokens: int, top: int | None, chat: bool
) -> None:
    """The request's caps (:mod:`app.limits`) and the values that depend on each other."""
    settings, info = request.app.state.settings, request.app.state.worker.model_info or {}
    field = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens:
        field = "max_completion_tokens"
    check_max_tokens(settings, field, max_tokens, info.get("window"))
    check_stops(settings, body.stops)
    check_generation(
        settings,
        n=body.n,
        logprobs=top,
        logprobs_field="top_logprobs" if chat else "logprobs",
        stop_token_ids=body.stop_token_ids or (),
    )
    if body.min_tokens > max_tokens:
        raise ApiError(
            422, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens"
        )
    vocab = info.get("vocab_size")
    if vocab and any(t >= vocab for t in body.stop_token_ids or ()):
        raise ApiError(422, f"stop_token_ids: ids must be < {vocab}", "stop_token_ids")


async def _run(request: Request, body: OpenAIRequest, prepare, max_tokens: int | None, chat: bool):
    state = request.app.state
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS
    top = _logprobs(body, chat)
    _check_sampling(request, body, max_tokens, top, chat)
    cfg = sampling(body)
    job = Job(prepare, max_tokens, cfg, body.speculative.mode, n=body.n, logprobs=top)
    timeout = state.settings.request_timeout
    run = Run(state.worker, job, body.stops, timeout, hidden=cfg.stop_token_ids)
    prepared = await run.start()
    tok = state.worker.detokenizer
    # Chat only: the thinking goes apart from the answer where the model has think tags.
    splitters = [
        reasoning.splitter_for(tok, prepared.prompt_ids) if chat else None for _ in range(body.n)
    ]
    shape = Shape(chat, tok, top is not None, splitters)
    prefix = "chatcmpl" if chat else "cmpl"
    rid, created, model = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), state.model_name
    obj = "chat.completion" if chat else "text_completion"
    if not body.stream:
        out = await run.collect(request)
        result = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": await run_in_threadpool(shape.choices, out.choices),
            **figures(out),
        }
        return result

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    head = {"id": rid, "object": "chat.completion.chunk" if chat else obj}
    head |= {"created": created, "model": model}

    async def events():
        try:
            async for delta in run.deltas():
                # Log-probabilities spell every alternative: rendered off the event loop.
                chunks = (
                    await run_in_threadpool(shape.chunks, delta)
                    if delta.logprobs
                    else shape.chunks(delta)
                )
                for choice in chunks:
                    yield sse(
                        {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
                    )
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(run.outcome)})
        except Exception as exc:  # mid-stream: the status is already sent
            log.info("request %s: stream ended by %r", request_id(request), exc)
            yield sse(error_payload(exc, request_id(request)))
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completions (see the module docstring)."""
    check_model(request, body.model)
    users = [m.text for m in body.messages if m.role == "user"]
    system = "\n\n".join(m.text for m in body.messages if m.role in ("system", "developer"))
    template_vars = body.chat_template_kwargs
    prepare = _document_prepare(request, body, users[-1] if users else "", system, template_vars)
    if prepare is not None and not users:
        raise ApiError(422, "a document needs a user message (the question)", "messages")
    if prepare is None:
        prepare = prompts.chat([(m.role, m.text) for m in body.messages], template_vars)
    return await _run(request, body, prepare, body.max_completion_tokens or body.max_tokens, True)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completions (see the module docstring)."""
    check_model(request, body.model)
    prepare = _document_prepare(request, body, body.text, "") or prompts.text(body.text)
    return await _run(request, body, prepare, body.max_tokens, False)


@router.get("/models")
async def models(request: Request):
    state = request.app.state
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.started,
                "owned_by": "d3d",
                "max_model_len": (state.worker.model_info or {}).get("window"),
            }
        ],
    }
