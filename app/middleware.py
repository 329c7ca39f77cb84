"""Per-request context as plain ASGI middleware: request id, body-size limit, request metrics.

Plain ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client disconnects pass
through untouched. Metrics are labelled by the matched route's path template, so arbitrary URLs
cannot blow up the label set.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from app.metrics import Metrics

log = logging.getLogger("app")


class RequestContext:
    def __init__(self, app, metrics: Metrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body = app, metrics, max_body_bytes

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

        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            length = 0
        try:
            if length > self.max_body:
                status = 413
                await self._too_large(send_with_id, rid, length)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "other"
            self.metrics.observe_request(path, scope["method"], status, time.perf_counter() - t0)

    async def _too_large(self, send, rid: str, length: int) -> None:
        msg = f"the request body is {length} bytes; the limit is {self.max_body} bytes"
        log.info("request %s: 413 %s", rid, msg)
        body = json.dumps(
            {
                "error": {
                    "message": msg,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": 413,
                },
                "request_id": rid,
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
