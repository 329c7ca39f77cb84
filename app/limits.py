"""Per-request caps, read from :class:`~app.settings.ServeSettings`, checked as a request enters.

The settings own every limit (``--max-new-tokens``, ``--max-n``, ``--max-logprobs``,
``--max-stop-sequences``, ``--max-stop-chars``, ``--max-stop-token-ids``); the request schemas
only say what a value means (a count is >= 0). A request past a limit is refused before any work
is queued, with 422 naming the field, the limit and the setting that owns it, so an operator who
raises one knows which flag to turn. ``max_tokens`` is also bounded by the model's window: no
answer can be longer than the model reads.

Body size, PDF pages, characters and time, and the document's tokens are checked where those
inputs enter (:mod:`app.middleware`, :mod:`app.pdf`, :mod:`app.documents`).
"""

from __future__ import annotations

from collections.abc import Sequence

from app.errors import ApiError
from app.settings import ServeSettings


def refuse(field: str, message: str, setting: str) -> ApiError:
    """422 naming the field, what was wrong, and the setting that owns the limit."""
    flag = "--" + setting.replace("_", "-")
    return ApiError(422, f"{field}: {message} ({flag}, D3D_{setting.upper()})", field)


def check_max_tokens(
    settings: ServeSettings, field: str, max_tokens: int, window: int | None
) -> None:
    """``max_tokens`` (or ``max_new_tokens``) within the service's cap and the model's window."""
    if max_tokens > settings.max_new_tokens:
        msg = f"{max_tokens} is over the limit of {settings.max_new_tokens} tokens"
        raise refuse(field, msg, "max_new_tokens")
    if window and max_tokens > window:
        raise ApiError(
            422, f"{field}: {max_tokens} is longer than the model's window of {window}", field
        )


def check_stops(settings: ServeSettings, stops: Sequence[str]) -> None:
    """Stop strings: how many and how long (each push scans ``longest - 1`` characters back)."""
    if len(stops) > settings.max_stop_sequences:
        msg = f"{len(stops)} stop strings; the limit is {settings.max_stop_sequences}"
        raise refuse("stop", msg, "max_stop_sequences")
    longest = max((len(s) for s in stops), default=0)
    if longest > settings.max_stop_chars:
        msg = f"a stop string of {longest} characters; the limit is {settings.max_stop_chars}"
        raise refuse("stop", msg, "max_stop_chars")


def check_generation(
    settings: ServeSettings,
    *,
    n: int,
    logprobs: int | None,
    logprobs_field: str,
    stop_token_ids: Sequence[int],
) -> None:
    """Choices, log-probability alternatives and stop ids per request."""
    if n > settings.max_n:
        raise refuse("n", f"{n} choices; the limit is {settings.max_n}", "max_n")
    if logprobs is not None and logprobs > settings.max_logprobs:
        msg = f"{logprobs} alternatives per token; the limit is {settings.max_logprobs}"
        raise refuse(logprobs_field, msg, "max_logprobs")
    if len(stop_token_ids) > settings.max_stop_token_ids:
        msg = f"{len(stop_token_ids)} ids; the limit is {settings.max_stop_token_ids}"
        raise refuse("stop_token_ids", msg, "max_stop_token_ids")
