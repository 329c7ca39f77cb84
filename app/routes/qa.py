"""``POST /qa``: a document and a question in, an answer with its compression and speed figures out.

The body is JSON (:class:`~app.schemas.QARequest`) or multipart form data with the document as a
file (``.txt``, ``.md``, ``.pdf``) and the other fields as form fields. With ``stream: true`` the
answer comes as server-sent events: ``{"type": "compression", ...}`` first (kept spans, so a page
can highlight the document at once), then ``{"type": "delta", "text"}`` chunks, then
``{"type": "done", ...}`` with the full response, then ``[DONE]``. With ``return_prompt: true``
the response also holds ``prompt``: the exact text the target read (its prompt ids decoded,
chat template included; non-thinking for Qwen3).
"""

from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from app import prompts
from app.engines.jobs import Job
from app.errors import ApiError, request_id
from app.generation import Outcome, Run
from app.limits import check_max_tokens
from app.pdf import pdf_text
from app.routes.common import (
    SSE_DONE,
    SSE_HEADERS,
    compression_view,
    error_payload,
    figures,
    sampling,
    sse,
)
from app.schemas import SEED_MAX, SEED_MIN, QARequest
from app.settings import ServeSettings

log = logging.getLogger("app.qa")
router = APIRouter()
UPLOAD_TYPES = (".txt", ".md", ".markdown", ".pdf")


async def _upload_text(upload, settings: ServeSettings) -> str:
    name = (getattr(upload, "filename", "") or "").lower()
    if not name.endswith(UPLOAD_TYPES):
        raise ApiError(415, f"file {name!r}: upload .txt, .md or .pdf", "file")
    data = await upload.read()
    if name.endswith(".pdf"):
        return await pdf_text(data, settings)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(422, f"file {name!r} is not UTF-8 text", "file") from exc


def _invalid(exc: ValidationError) -> RequestValidationError:
    errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
    return RequestValidationError(errors)


async def parse(request: Request) -> QARequest:
    """JSON or multipart into a validated :class:`QARequest` (422 naming the field); a PDF's
    text is read off the event loop, within its limits (:mod:`app.pdf`)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if ctype == "multipart/form-data":
            form = await request.form()
            fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
            files = [v for _, v in form.multi_items() if not isinstance(v, str)]
            if files:
                if "document" in fields:
                    raise ApiError(422, "send the document as a file or a field, not both", "file")
                fields["document"] = await _upload_text(files[0], request.app.state.settings)
            if "speculative" in fields:
                fields["speculative"] = {"mode": fields.pop("speculative")}
            return QARequest.model_validate(fields)
        if ctype in ("application/json", ""):
            return QARequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise _invalid(exc) from exc
    raise ApiError(415, f"unsupported content type {ctype!r}: send JSON or multipart/form-data")


def response(rid: str, out: Outcome, model: str) -> dict:
    prepared = out.prepared
    info = prepared.info if prepared else {}
    st = out.stats
    result = {
        "id": rid,
        "object": "qa.answer",
        "model": model,
        "answer": out.text.strip(),
        "finish_reason": out.finish_reason,
        **figures(out),
        "timings": {
            "queue_s": round(out.queue_s, 4),
            "compress_s": round(prepared.seconds if prepared else 0.0, 4),
            "prefill_s": st.get("prefill_seconds", 0.0),
            "decode_s": st.get("decode_seconds", 0.0),
            "total_s": round(out.total_s, 4),
        },
    }
    if "prompt" in info:
        result["prompt"] = info["prompt"]
    return result


OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/QARequest"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["question", "file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "question": {"type": "string", "minLength": 1},
                        "keep_ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                        "scorer": {"type": "string"},
                        "max_new_tokens": {"type": "integer", "minimum": 1},
                        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                        "seed": {"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX},
                        "speculative": {"type": "string"},
                        "return_prompt": {"type": "boolean"},
                    },
                    "additionalProperties": False,
                }
            },
        },
    }
}


@router.post("/qa", openapi_extra=OPENAPI, tags=["qa"])
async def qa(request: Request):
    """Answer a question about a document (see the module docstring); the API key is checked
    before the body is read (:mod:`app.middleware`)."""
    body = await parse(request)
    state = request.app.state
    settings = state.settings
    window = (state.worker.model_info or {}).get("window")
    check_max_tokens(settings, "max_new_tokens", body.max_new_tokens, window)
    job = Job(
        prompts.qa(
            body.document,
            body.question,
            body.keep_ratio,
            body.scorer,
            settings.max_document_tokens,
            body.return_prompt,
        ),
        body.max_new_tokens,
        sampling(body),
        body.speculative.mode,
    )
    run = Run(state.worker, job, timeout=settings.request_timeout)
    prepared = await run.start()
    if state.worker.metrics is not None:
        state.worker.metrics.keep_ratio.observe(
            prepared.info.get("kept_context_tokens", 0)
            / max(1, prepared.info.get("context_tokens", 1))
        )
    rid = f"qa-{uuid.uuid4().hex[:16]}"
    model = state.model_name
    if not body.stream:
        return response(rid, await run.collect(request), model)

    async def events():
        yield sse(
            {"type": "compression", "id": rid, "compression": compression_view(prepared.info)}
        )
        try:
            async for delta in run.deltas():
                if delta.text:
                    yield sse({"type": "delta", "text": delta.text})
            yield sse({"type": "done", **response(rid, run.outcome, model)})
        except Exception as exc:  # mid-stream: the status is already sent
            log.info("request %s: stream ended by %r", request_id(request), exc)
            yield sse({"type": "error", **error_payload(exc, request_id(request))})
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
