"""Models from specs: the devices checked, the drafter built against its target, and the
picklable factory a drafter process builds its drafter with (specs cross, never tensors)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from d3d.backends import Backend, choose
from d3d.config import ModelConfig
from d3d.engine.placement import Placement, PlacementError, parse_cores, resolve_placement
from d3d.model.drafter import D3DDrafter, DrafterError
from d3d.model.load import LoadedModel, ModelLoadError, load_target_part
from d3d.model.specs import borrowed_layers, self_layers, speculation
from d3d.replay.spec import is_replay, parse_replay

if TYPE_CHECKING:
    from d3d.replay import ReplayDrafter

log = logging.getLogger(__name__)


def check_device(device: str) -> None:
    """Fail fast on a device this host does not have."""
    if device.startswith("cpu:"):
        try:
            parse_cores(device[4:])
        except PlacementError as exc:
            raise ModelLoadError(str(exc)) from None
    elif device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
    elif device != "cpu" and not device.startswith("mps"):
        raise ModelLoadError(f"unknown device {device!r} (use cpu, cuda or cuda:N)")


def build_drafter(
    spec: str, target: LoadedModel, device: str | None = None, share_layers: bool = False
) -> D3DDrafter | ReplayDrafter | None:
    """Resolve a drafter spec against a loaded target (see :mod:`d3d.model.specs`; a
    ``replay:`` spec is the replay instrument, :mod:`d3d.replay`); None where speculation is
    off (no trained drafter for the target, or ``none``: the log says which).
    ``share_layers``: a ``self:`` drafter runs on the target's own layer tensors (inference:
    no second copy) instead of copies that training may update."""
    if is_replay(spec):  # the measurement instrument (d3d.replay), never a default
        from d3d.replay import build_replay

        shape = replay_shape(spec)  # a drafter spec shape is built here, the engine's way
        built = None if shape is None else build_drafter(shape, target, device, share_layers)
        if shape is not None and built is None:
            raise DrafterError(f"a replay's drafter shape must name a drafter: {spec!r}")
        return build_replay(spec, target, device, shape=built)
    chosen = speculation(spec, target.spec)
    if chosen.drafter is None:
        log.warning("speculation off: %s", chosen.reason)
        return None
    resolved = chosen.drafter
    layers = self_layers(resolved)
    if layers is not None:
        return D3DDrafter.from_target(
            target.model, layers, base=target.spec, device=device, share=share_layers
        )
    path = Path(resolved).expanduser()
    if not path.exists():
        raise DrafterError(f"drafter checkpoint not found: {path}")
    return D3DDrafter.load(path, target.model, device=device)


@dataclass(frozen=True)
class DrafterFactory:
    """Builds the drafter from model specs in another process (picklable: specs, no tensors),
    on ``device`` (the CPU, or the drafter's own GPU)."""

    cfg: ModelConfig
    device: str = "cpu"

    def __call__(self) -> D3DDrafter | ReplayDrafter:
        # Only what the drafter reads, in the configured dtype: its layers (if the target's),
        # the embeddings, LM head and final norm; the target's other layers are never read.
        target = load_target_part(
            self.cfg.target,
            lambda _depth: drafter_layers(self.cfg.drafter, self.cfg.target),
            device=self.device,
            dtype=self.cfg.dtype,
        )
        drafter = build_drafter(self.cfg.drafter, target, self.device, share_layers=True)
        if drafter is None:
            raise DrafterError(speculation(self.cfg.drafter, self.cfg.target).reason)
        drafter_backend(self.cfg, self.device).prepare_drafter(drafter.lm)
        return drafter


def replay_shape(spec: str) -> str | None:
    """The drafter spec a replay spec names as its shape, which the engine builds (None: no
    shape, or a ``shape=CONFIG`` one that the replay builds itself)."""
    from d3d.replay.shape import is_random

    shape = parse_replay(spec).shape
    if shape and is_replay(shape):
        raise DrafterError(f"a replay's drafter shape cannot be a replay: {spec!r}")
    return shape if shape and not is_random(shape) else None


def drafter_layers(spec: str, target_spec: str) -> tuple[int, ...]:
    """The target's layers a drafter of ``spec`` reads (:func:`d3d.model.specs.borrowed_layers`;
    a replay's, those of the drafter shape it runs, if any)."""
    if is_replay(spec):
        shape = replay_shape(spec)
        return () if shape is None else borrowed_layers(shape, target_spec)
    return borrowed_layers(spec, target_spec)


def drafter_backend(cfg: ModelConfig, device: str | None = None) -> Backend:
    """The backend that readies the drafter's language model on its device (``device``:
    default the config's drafter device): the CPU's prepacked maps on a CPU, the cuda
    backend's packed, captured drafting on a GPU (:mod:`d3d.backends.cuda.drafter`), nothing
    elsewhere (the drafter worker drafts through the model's own forward)."""
    dev = device or cfg.resolved_drafter_device
    return choose("cpu" if dev == "cpu" else "auto", dev, pack=cfg.pack, fuse=cfg.fuse)


def placement_for(cfg: ModelConfig) -> Placement:
    """Where this config's drafter worker goes on this host (see :mod:`d3d.engine.placement`)."""
    from d3d.worker.workers import available_cores

    device = cfg.drafter_device
    if device is None and is_replay(cfg.drafter) and parse_replay(cfg.drafter).shape is None:
        device = cfg.target_device  # a replay that computes nothing: a thread beside the target
    return resolve_placement(cfg.target_device, device, available_cores())
