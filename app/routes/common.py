"""Helpers every generating route shares: the job's decode settings, SSE framing, error events.

(The API key is checked before a route runs: :mod:`app.auth`, :mod:`app.middleware`.)"""

from __future__ import annotations

import json

from app.errors import ApiError, public_message
from app.generation import Outcome
from app.schemas import Sampling, VllmSampling
from d3d.config import SamplingConfig

TIMING_KEYS = ("prefill_seconds", "decode_seconds", "draft_seconds", "verify_seconds")
NOT_SPECULATIVE = ("prompt_tokens", "num_tokens", "tokens_per_second", "stop_reason", *TIMING_KEYS)


def sampling(body: Sampling) -> SamplingConfig:
    """The request's sampling settings (vLLM's fields too where the route takes them)."""
    extra: dict = {}
    if isinstance(body, VllmSampling):
        extra = body.model_dump(include=set(VllmSampling.model_fields))
        extra["top_k"] = max(extra["top_k"], 0)  # vLLM's -1 is off, as 0 is
        extra["stop_token_ids"] = tuple(extra["stop_token_ids"] or ())
    return SamplingConfig(temperature=body.temperature, top_p=body.top_p, seed=body.seed, **extra)


def speculative_view(stats: dict) -> dict:
    """The decode statistics that describe speculation (vLLM names), passed through as they are."""
    return {k: v for k, v in stats.items() if k not in NOT_SPECULATIVE}


def compression_view(info: dict) -> dict:
    """What compression did: the prepared info less the prompt text (reported on its own)."""
    return {k: v for k, v in info.items() if k != "prompt"}


def usage(out: Outcome) -> dict:
    """OpenAI's usage object over every choice (the prompt counted once); ``cached_tokens``:
    prompt tokens taken from the prefix cache."""
    stats = out.stats
    p, c = int(stats.get("prompt_tokens", 0)), out.completion_tokens
    cached = int(stats.get("cached_prompt_tokens", 0))
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def figures(out: Outcome) -> dict:
    """What every finished answer reports beside its text: ``usage``, ``speculative`` and, where
    a document was compressed, ``compression``."""
    info = out.prepared.info if out.prepared else {}
    result = {"usage": usage(out), "speculative": speculative_view(out.stats)}
    if info:
        result["compression"] = compression_view(info)
    return result


def sse(payload: object) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_payload(exc: BaseException, request_id: str) -> dict:
    if isinstance(exc, ApiError):
        message = public_message(exc)
        err = {"message": message, "type": exc.kind, "param": exc.param, "code": exc.status}
    else:
        err = {"message": "internal error", "type": "server_error", "param": None, "code": 500}
    return {"error": err, "request_id": request_id}
