"""The API key: which routes need it, and how a bearer token is compared with it.

One rule, used in two places: :class:`app.middleware.RequestContext` refuses a caller without
the key on the generating routes before the body is read, and ``/ready`` gives its details
(model paths, the drafter worker's pid, a load error's text) only to a caller with the key.
With no key set, every caller has it.

Tokens are compared as bytes (``hmac.compare_digest``, constant time): a header is bytes on the
wire (Starlette hands it over as latin-1 text), the key is UTF-8, so a token with non-ASCII
characters is simply a wrong key, 401, never a 500.
"""

from __future__ import annotations

import hmac

UNAUTHORIZED = "missing or wrong API key (send Authorization: Bearer <key>)"
KIND = "authentication_error"
HEADERS = {"WWW-Authenticate": "Bearer"}


def protected(path: str) -> bool:
    """Whether ``path`` needs the key: the OpenAI routes and ``/qa`` (``/health``, ``/ready``,
    ``/metrics`` and the page do not)."""
    return path in ("/v1", "/qa") or path.startswith(("/v1/", "/qa/"))


def authorized(authorization: str, key: str | None) -> bool:
    """Whether an ``Authorization`` header (as Starlette decodes it) carries ``key``."""
    if not key:
        return True
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip(" \t").encode("latin-1"), key.encode("utf-8"))
