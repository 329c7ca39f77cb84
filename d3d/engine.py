"""The engine: a loaded target and drafter, and text in / text out over the decode loop.

This is the library's front object, used by the CLI, the web app and the evaluation harness. It
resolves model specs (see :class:`d3d.config.ModelConfig`), checks at load that the drafter fits
the target (same vocabulary, device present), and turns a prompt into a :class:`Generation`.

Drafter specs: ``default`` (the checkpoint shipped in ``d3d/checkpoints/`` for the embedded
target, else the target's first 4 layers, untrained), ``self:N`` (the target's first N layers,
untrained), ``self:0,5,9`` (those layers), or a checkpoint directory written by
:meth:`D3DDrafter.save`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from d3d.config import DecodeConfig, ModelConfig
from d3d.decode import ArProposer, DecodeStats, Proposer, SyncProposer, decode
from d3d.drafter import D3DDrafter, DrafterError
from d3d.models import DEFAULT_SPECS, LoadedModel, ModelLoadError, encode_prompt, load_target

log = logging.getLogger(__name__)

CHECKPOINTS = Path(__file__).parent / "checkpoints"
DEFAULT_DRAFTER_DIR = CHECKPOINTS / "smollm2-135m"
FALLBACK_LAYERS = 4


def check_device(device: str) -> None:
    """Fail fast on a device this host does not have."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
    elif device != "cpu" and not device.startswith("mps"):
        raise ModelLoadError(f"unknown device {device!r} (use cpu, cuda or cuda:N)")


def build_drafter(spec: str, target: LoadedModel, device: str | None = None) -> D3DDrafter:
    """Resolve a drafter spec against a loaded target (see the module docstring)."""
    if spec == "default":
        shipped = (
            target.spec.lower() in DEFAULT_SPECS
            and (DEFAULT_DRAFTER_DIR / "drafter.json").is_file()
        )
        if shipped:
            spec = str(DEFAULT_DRAFTER_DIR)
        else:
            n = min(FALLBACK_LAYERS, target.model.config.num_hidden_layers)
            log.warning(
                "no trained drafter for %s: using its first %d layers, untrained", target.spec, n
            )
            spec = f"self:{n}"
    if spec.startswith("self:"):
        body = spec[len("self:") :]
        try:
            layers: int | list[int] = (
                [int(x) for x in body.split(",")] if "," in body else int(body)
            )
        except ValueError as exc:
            raise DrafterError(f"bad drafter spec {spec!r}: use self:N or self:i,j,k") from exc
        return D3DDrafter.from_target(target.model, layers, base=target.spec, device=device)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DrafterError(f"drafter checkpoint not found: {path}")
    return D3DDrafter.load(path, target.model, device=device)


@dataclass
class Generation:
    """A finished request: the text, the generated ids and the decode statistics."""

    text: str
    token_ids: list[int]
    stats: DecodeStats

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids}
        out.update(self.stats.to_dict())
        return out


class Engine:
    """A target (and optionally a drafter) ready to decode."""

    def __init__(self, target: LoadedModel, drafter: D3DDrafter | None = None):
        self.target = target
        self.drafter = drafter
        if drafter is not None and drafter.meta.vocab_size not in (0, target.vocab_size):
            raise DrafterError(
                f"drafter vocabulary ({drafter.meta.vocab_size}) does not match the target's ({target.vocab_size})"
            )

    @classmethod
    def from_config(cls, cfg: ModelConfig, with_drafter: bool = True) -> Engine:
        check_device(cfg.target_device)
        check_device(cfg.resolved_drafter_device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        target = load_target(cfg.target, device=cfg.target_device, dtype=cfg.dtype)
        drafter = (
            build_drafter(cfg.drafter, target, cfg.resolved_drafter_device)
            if with_drafter
            else None
        )
        return cls(target, drafter)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def proposer(self, mode: str) -> Proposer:
        if mode == "ar":
            return ArProposer()
        if self.drafter is None:
            raise DrafterError(f"mode {mode!r} needs a drafter, and none is loaded")
        return SyncProposer(self.drafter)

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat_template)

    def stream(
        self, prompt_ids: Sequence[int], cfg: DecodeConfig, stats: DecodeStats | None = None
    ) -> Iterator[list[int]]:
        """Token chunks as the rounds commit them; ``stats`` is complete when this ends."""
        window = getattr(self.target.model.config, "max_position_embeddings", None)
        if window and len(prompt_ids) + cfg.max_new_tokens + cfg.block_size > window:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) "
                f"exceeds the model's {window}-token window"
            )
        stats = stats if stats is not None else DecodeStats(mode=cfg.mode)
        return decode(
            self.target.model,
            self.proposer(cfg.mode),
            prompt_ids,
            cfg,
            self.target.eos_token_ids,
            stats,
        )

    def generate_ids(self, prompt_ids: Sequence[int], cfg: DecodeConfig) -> Generation:
        stats = DecodeStats(mode=cfg.mode)
        ids = [t for chunk in self.stream(prompt_ids, cfg, stats) for t in chunk]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(text=text, token_ids=ids, stats=stats)

    def generate(self, prompt: str, cfg: DecodeConfig) -> Generation:
        return self.generate_ids(self.encode(prompt, cfg.chat_template), cfg)
