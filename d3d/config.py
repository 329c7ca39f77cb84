"""Frozen, validated configuration for the engine.

Every knob a request or a deployment can turn lives here as a small frozen dataclass that checks
itself once in ``__post_init__`` and names the offending field in its error. The CLI and the web
app build these from their own inputs (flags, JSON bodies, environment) and hand them to the
library; nothing below reads flags or the environment on its own, except ``ModelConfig.from_env``
which is the one place that maps ``D3D_*`` variables onto a config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

MODES = ("auto", "ar", "sync", "async")
BACKENDS = ("auto", "reference", "cpu", "cuda")  # d3d.backends.NAMES
DEFAULT_BLOCK_SIZE = 16


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def _flag(value: str) -> bool:
    """An on/off environment setting: off for 0, false, no, off."""
    return value.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution is turned into tokens.

    ``temperature == 0`` is greedy decoding (the argmax of the processed logits; ``top_p``,
    ``top_k``, ``min_p`` and ``seed`` are ignored). The rest are vLLM's sampling parameters with
    vLLM's meanings:

    - penalties on the logits, from the row's history (:mod:`d3d.decoding.processors`):
      ``repetition_penalty`` (> 1 discourages every token of the prompt or the output so far),
      ``presence_penalty`` / ``frequency_penalty`` (subtracted once / per occurrence in the
      output so far);
    - truncation of the distribution after the temperature (:func:`~d3d.sampling.
      probabilities`): ``min_p`` (drop tokens below ``min_p`` times the most likely one's
      probability), ``top_k`` (0: off), ``top_p``;
    - stopping: ``stop_token_ids`` end the row like EOS; ``ignore_eos`` lets EOS through as an
      ordinary token; ``min_tokens``: no stop token (EOS included) before that many tokens.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (0: off), got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be token ids >= 0, got {list(self.stop_token_ids)}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether the logits depend on the row's history (a penalty is set)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def stops(self, eos_ids: set[int]) -> set[int]:
        """The ids that end a row: the model's EOS ids (unless ``ignore_eos``) and
        ``stop_token_ids``."""
        return (set() if self.ignore_eos else set(eos_ids)) | set(self.stop_token_ids)


@dataclass(frozen=True)
class DecodeConfig:
    """One request's decoding settings."""

    mode: str = "auto"
    max_new_tokens: int = 256
    block_size: int = DEFAULT_BLOCK_SIZE
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chat_template: bool = True
    copy: bool = True  # auto: verify copies of the request's own text where they pay

    def __post_init__(self) -> None:
        _check(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        _check(
            self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"
        )
        _check(self.block_size >= 2, "block_size", f"must be >= 2, got {self.block_size}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30})


@dataclass(frozen=True)
class CacheBudget:
    """How much memory the target's prefix cache may hold.

    ``fraction``: that share of the free memory on the target's device once its weights are
    loaded; ``bytes``: a size; ``tokens``: that many tokens at the target's KV bytes per token.
    Text forms (:meth:`parse`): ``auto`` (10% of free memory), ``25%``, ``4GiB`` / ``512MB`` /
    a byte count (KiB, MiB, GiB and K, M, G are powers of 2; KB, MB, GB powers of 10),
    ``32768tok``; ``0`` keeps nothing.
    """

    kind: str = "fraction"
    value: float = 0.1

    def __post_init__(self) -> None:
        _check(
            self.kind in ("fraction", "bytes", "tokens"), "prefix_cache", f"bad kind {self.kind!r}"
        )
        _check(self.value >= 0, "prefix_cache", f"must be >= 0, got {self.value}")
        _check(
            self.kind != "fraction" or self.value <= 1, "prefix_cache", "a share must be <= 100%"
        )

    @classmethod
    def parse(cls, text: str) -> CacheBudget:
        t = text.strip().lower().replace(" ", "")
        try:
            if t == "auto":
                return cls()
            if t.endswith("%"):
                return cls("fraction", float(t[:-1]) / 100)
            for suffix in ("tokens", "tok"):
                if t.endswith(suffix):
                    return cls("tokens", float(int(t[: -len(suffix)])))
            digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
            return cls("bytes", float(int(float(digits) * _UNITS[t[len(digits) :]])))
        except ConfigError:
            raise
        except (KeyError, ValueError):
            raise ConfigError(
                f"prefix_cache: {text!r} is not auto, a share (25%), a size (4GiB) or tokens "
                "(32768tok)"
            ) from None

    def resolve(self, kv_bytes_per_token: int, free_bytes: int) -> int:
        """The budget in bytes, given the target's KV bytes per token and the free memory."""
        if self.kind == "fraction":
            return int(self.value * free_bytes)
        if self.kind == "tokens":
            return int(self.value) * kv_bytes_per_token
        return int(self.value)


@dataclass(frozen=True)
class ModelConfig:
    """Which target and drafter to load, and where.

    ``target`` is ``"default"`` (the embedded SmolLM2-135M-Instruct), a Hugging Face id, a local
    directory, or a ``.gguf`` file. ``drafter`` is ``"default"`` (the checkpoint shipped for the
    embedded target, else the target's first layers), ``"self:N"`` (an untrained drafter made of
    the target's first N layers), ``"self:0,3,7"`` (those layers), or a checkpoint directory.
    """

    target: str = "default"
    drafter: str = "default"
    target_device: str = "cpu"
    drafter_device: str | None = None
    dtype: str = "auto"
    threads: int | None = None
    backend: str = "auto"  # how the target runs: auto, reference, cpu, cuda (d3d.backends)
    pack: bool = True  # float32 CPU linear maps prepacked for oneDNN (d3d.backends.cpu.packing)
    fuse: bool = True  # vLLM's CPU kernels where installed (d3d.backends.cpu.fused, .packing)
    costs_dir: str | None = None  # keep auto's measured costs here between processes
    max_kv_tokens: int | None = None  # the target's KV budget (None: from free device memory)
    prefix_cache: str = "auto"  # the target's prefix-cache budget (CacheBudget.parse)

    def __post_init__(self) -> None:
        _check(bool(self.target.strip()), "target", "must not be empty")
        _check(bool(self.drafter.strip()), "drafter", "must not be empty")
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        _check(self.threads is None or self.threads >= 1, "threads", "must be >= 1")
        _check(
            self.backend in BACKENDS,
            "backend",
            f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}",
        )
        _check(
            self.max_kv_tokens is None or self.max_kv_tokens >= 16,
            "max_kv_tokens",
            f"must be >= 16, got {self.max_kv_tokens}",
        )
        CacheBudget.parse(self.prefix_cache)  # raises naming the field

    @property
    def cache_budget(self) -> CacheBudget:
        return CacheBudget.parse(self.prefix_cache)

    @property
    def resolved_drafter_device(self) -> str:
        """The drafter's torch device (``cpu:1``, a process on core 1, is the CPU)."""
        dev = self.drafter_device or self.target_device
        return "cpu" if dev.startswith("cpu") else dev

    @classmethod
    def from_env(cls, **overrides: object) -> ModelConfig:
        """Build from ``D3D_TARGET``, ``D3D_DRAFTER``, ``D3D_TARGET_DEVICE``, ``D3D_DRAFTER_DEVICE``,
        ``D3D_DTYPE``, ``D3D_THREADS``, ``D3D_BACKEND`` (:mod:`d3d.backends`), ``D3D_PACK`` (``0``: no prepacked linear maps), ``D3D_FUSE``
        (``0``: none of vLLM's CPU kernels),
        ``D3D_COSTS_DIR`` (:mod:`d3d.engine.cost_memory`), ``D3D_MAX_KV_TOKENS`` and
        ``D3D_PREFIX_CACHE`` (:class:`CacheBudget`); explicit keyword overrides win when not
        None."""
        env = os.environ
        values: dict[str, object] = {
            "target": env.get("D3D_TARGET", "default"),
            "drafter": env.get("D3D_DRAFTER", "default"),
            "target_device": env.get("D3D_TARGET_DEVICE", "cpu"),
            "drafter_device": env.get("D3D_DRAFTER_DEVICE") or None,
            "dtype": env.get("D3D_DTYPE", "auto"),
            "threads": int(env["D3D_THREADS"]) if env.get("D3D_THREADS") else None,
            "backend": env.get("D3D_BACKEND") or "auto",
            "pack": _flag(env.get("D3D_PACK", "1")),
            "fuse": _flag(env.get("D3D_FUSE", "1")),
            "costs_dir": env.get("D3D_COSTS_DIR") or None,
            "max_kv_tokens": int(env["D3D_MAX_KV_TOKENS"])
            if env.get("D3D_MAX_KV_TOKENS")
            else None,
            "prefix_cache": env.get("D3D_PREFIX_CACHE") or "auto",
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
