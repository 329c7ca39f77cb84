"""Drafter specs: what ``--drafter`` names, and which of the target's layers it reads.

``default`` is the checkpoint shipped in ``d3d/checkpoints/`` for the embedded target, else the
target's first :data:`FALLBACK_LAYERS` layers (untrained); ``self:N`` is the target's first N
layers, ``self:0,5,9`` those layers; anything else is a checkpoint folder written by
:meth:`d3d.model.drafter.D3DDrafter.save`.

:func:`borrowed_layers` answers from the spec and the checkpoint's JSON alone, before any weight
is read, so a drafter process can load just those layers of its target
(:func:`d3d.model.load.load_target_part`). :func:`d3d.engine.build_drafter` and the planner
(:mod:`d3d.tools.plan`) read specs through the same functions.
"""

from __future__ import annotations

import json
from pathlib import Path

from d3d.model.drafter import META_FILE, DrafterError
from d3d.model.load import DEFAULT_SPECS

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
DEFAULT_DRAFTER_DIR = CHECKPOINTS / "smollm2-135m"
FALLBACK_LAYERS = 4


def resolve_spec(spec: str, target_spec: str, depth: int) -> str:
    """``default`` -> the shipped checkpoint (embedded target) or ``self:N``; other specs as
    given. ``depth``: the target's number of decoder layers."""
    if spec != "default":
        return spec
    if target_spec.lower() in DEFAULT_SPECS and (DEFAULT_DRAFTER_DIR / META_FILE).is_file():
        return str(DEFAULT_DRAFTER_DIR)
    return f"self:{min(FALLBACK_LAYERS, depth)}"


def self_layers(spec: str) -> int | list[int] | None:
    """The layers of a ``self:`` spec (a count, or indices); None for any other spec."""
    if not spec.startswith("self:"):
        return None
    body = spec[len("self:") :]
    try:
        return [int(x) for x in body.split(",")] if "," in body else int(body)
    except ValueError as exc:
        raise DrafterError(f"bad drafter spec {spec!r}: use self:N or self:i,j,k") from exc


def borrowed_layers(spec: str, target_spec: str, depth: int) -> tuple[int, ...]:
    """Indices of the target's decoder layers the drafter of ``spec`` is made of (besides the
    embeddings and LM head every drafter reads): a ``self:`` spec's, an adapter checkpoint's
    over the target; none for a checkpoint that stores its own layers or was initialised from
    another model (``init``)."""
    spec = resolve_spec(spec, target_spec, depth)
    layers = self_layers(spec)
    if layers is not None:
        return tuple(range(layers)) if isinstance(layers, int) else tuple(layers)
    meta_file = Path(spec).expanduser() / META_FILE
    if not meta_file.is_file():
        raise DrafterError(f"drafter checkpoint not found: {meta_file.parent}")
    try:
        meta = json.loads(meta_file.read_text())["meta"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DrafterError(f"{meta_file} is unreadable: {exc}") from exc
    own = meta.get("init") is not None or not meta.get("adapter")
    return () if own else tuple(int(i) for i in meta["layers"])
