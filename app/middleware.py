"""Per-request context as plain ASGI middleware: request id, API key, body limit, metrics.

Plain ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client disconnects pass
through untouched. What it refuses, it refuses before the route runs or as the body streams in:

- the API key (:mod:`app.auth`) on ``/v1/*`` and ``/qa``: a caller without it is 401 before a
  byte of its body is read, parsed or validated;
- the body limit (``--max-body-bytes``): a declared ``Content-Length`` over it is 413 at once,
  and every body is counted as the app receives it, so a chunked one (no length) is refused
  with 413 (:class:`BodyTooLarge`) as soon as it passes the limit, not after it is buffered.

Metrics are labelled by the matched route's path template and a known HTTP method (anything
else is ``other``), so arbitrary URLs and methods cannot blow up the label set.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from starlette.exceptions import HTTPException

from app import auth
from app.metrics import Metrics

log = logging.getLogger("app")

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    """The metrics label of an HTTP method: a fixed set, whatever a client sends."""
    return method if method in METHODS else "other"


class BodyTooLarge(HTTPException):
    """The body passed ``--max-body-bytes`` while streaming in (FastAPI passes HTTPExceptions
    from a body read through, so the error handlers answer it as a 413)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over the limit of {limit} bytes")


class RequestContext:
    def __init__(self, app, metrics: Metrics, max_body_bytes: int, api_key: str | None = None):
        self.app, self.metrics, self.max_body, self.key = app, metrics, max_body_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.perf_counter()
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                hdrs = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in hdrs):
                    hdrs.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": hdrs}
            await send(message)

        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            length = 0
        try:
            if auth.protected(scope["path"]) and not auth.authorized(
                headers.get("authorization", ""), self.key
            ):
                status = 401
                await _refuse(send_with_id, rid, 401, auth.UNAUTHORIZED, auth.KIND, auth.HEADERS)
            elif length > self.max_body:
                status = 413
                msg = f"the request body is {length} bytes; the limit is {self.max_body} bytes"
                await _refuse(send_with_id, rid, 413, msg)
            else:
                await self.app(scope, counted, send_with_id)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "other"
            method = method_label(scope["method"])
            self.metrics.observe_request(path, method, status, time.perf_counter() - t0)


async def _refuse(
    send,
    rid: str,
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> None:
    """An error answered here, before the app: the same body shape as :mod:`app.errors`."""
    log.info("request %s: %d %s", rid, status, message)
    err = {"message": message, "type": kind, "param": None, "code": status}
    body = json.dumps({"error": err, "request_id": rid}).encode()
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
