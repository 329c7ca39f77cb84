"""Errors as clear HTTP answers: an OpenAI-style JSON body, a request id, never a traceback.

Every response carries ``X-Request-ID`` (the client's, or a new one); every error body is
``{"error": {"message", "type", "param", "code"}, "request_id"}`` and every error is logged
with the request id. Validation errors name the offending field (``param``): 422 for a body that
does not fit the schema (unknown fields included), 400 for malformed JSON. Anything unexpected is
a 500 whose body says only "internal error" and the request id, whatever raised it: an
:class:`ApiError` of status 500 (an engine's failure, e.g. vLLM's exception text) keeps its text
for the log (:func:`public_message`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("app")


class ApiError(Exception):
    """An error with an HTTP status and a message meant for the client."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


def public_message(exc: ApiError) -> str:
    """What a client may read of ``exc``: a 500's text stays in the log (it may name paths,
    a library's internals or another request's data)."""
    return "internal error" if exc.status == 500 else exc.message


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "-"


def error_response(
    request: Request,
    status: int,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    rid = request_id(request)
    level = logging.ERROR if status >= 500 else logging.INFO
    log.log(level, "request %s: %d %s", rid, status, message)
    body = {
        "error": {"message": message, "type": kind, "param": param, "code": status},
        "request_id": rid,
    }
    return JSONResponse(body, status_code=status, headers={**(headers or {}), "X-Request-ID": rid})


def field_name(loc: tuple) -> str:
    """``('body', 'speculative', 'mode')`` -> ``speculative.mode``."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "form")]
    return ".".join(parts) or "body"


def describe(errors: list[dict]) -> tuple[str, str | None, int]:
    """Message, field and status for pydantic/FastAPI validation errors."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    name = field_name(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('msg', '')}".strip(), None, 400
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{name}'", name, 422
    if first.get("type") == "missing":
        return f"missing field '{name}'", name, 422
    return f"{name}: {first.get('msg', 'invalid value')}", name, 422


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into a clear answer."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        if exc.status == 500:
            log.error("request %s: %s", request_id(request), exc.message)
        message = public_message(exc)
        return error_response(request, exc.status, message, exc.param, exc.kind, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param, status = describe(list(exc.errors()))
        return error_response(request, status, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request, exc.status_code, str(exc.detail), None, kind)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("request %s failed", request_id(request))
        return error_response(request, 500, "internal error", None, "server_error")
