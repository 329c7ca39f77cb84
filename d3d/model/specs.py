"""Drafter specs: what ``--drafter`` names, and which of the target's layers it reads.

``default`` is the checkpoint shipped in ``d3d/checkpoints/`` for the embedded target; a target
with no trained drafter is served without speculation, on purpose, and :func:`speculation` says
why (an untrained drafter only costs: every block it proposes is rejected). ``none`` (or ``off``)
turns speculation off; ``self:N`` is the target's first N layers, ``self:0,5,9`` those layers
(untrained unless trained since: a named choice, never a default); anything else is a
checkpoint folder written by :meth:`d3d.model.drafter.D3DDrafter.save`.

:func:`borrowed_layers` answers from the spec and the checkpoint's JSON alone, before any weight
is read, so a drafter process can load just those layers of its target
(:func:`d3d.model.load.load_target_part`). :func:`d3d.engine.build_drafter` and the planner
(:mod:`d3d.tools.plan`) read specs through the same functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from d3d.model.drafter import META_FILE, DrafterError
from d3d.model.load import DEFAULT_SPECS

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
DEFAULT_DRAFTER_DIR = CHECKPOINTS / "smollm2-135m"
NO_DRAFTER = ("none", "off", "")  # specs that turn speculation off
DRAFTER_MODES = ("sync", "async")  # the modes that cannot run without a drafter


def refusal(mode: str, on: bool, reason: str | None) -> str | None:
    """Why ``mode`` cannot run where speculation is ``on`` or off for ``reason`` (None: it can).
    The engine and the service both refuse with this message."""
    if mode in DRAFTER_MODES and not on:
        return (
            f"mode {mode!r} needs a drafter; speculation is off: {reason or 'no drafter is loaded'}"
        )
    return None


@dataclass(frozen=True)
class Speculation:
    """Whether a target is served with a drafter: ``drafter`` is the resolved spec (None:
    speculation off), ``reason`` says why it is off."""

    drafter: str | None
    reason: str = ""

    @property
    def on(self) -> bool:
        return self.drafter is not None

    def refusal(self, mode: str) -> str | None:
        """Why ``mode`` cannot run here (None: it can; :func:`refusal`)."""
        return refusal(mode, self.on, self.reason)

    def to_dict(self) -> dict:
        """The fields ``/ready`` and the log report."""
        return {
            "speculation": "on" if self.on else "off",
            "speculation_reason": self.reason or None,
        }


def speculation(spec: str, target_spec: str) -> Speculation:
    """Resolve ``--drafter`` against the target (see the module docstring)."""
    name = spec.strip()
    if name.lower() in NO_DRAFTER:
        return Speculation(None, f"speculation turned off (--drafter {name})")
    if name != "default":
        return Speculation(name)
    if target_spec.lower() in DEFAULT_SPECS and (DEFAULT_DRAFTER_DIR / META_FILE).is_file():
        return Speculation(str(DEFAULT_DRAFTER_DIR))
    return Speculation(
        None,
        f"no trained drafter for {target_spec}: train one with `d3d train` (docs/training.md) "
        "and name it with --drafter PATH (D3D_DRAFTER)",
    )


def resolve_spec(spec: str, target_spec: str) -> str | None:
    """The drafter spec ``spec`` names for ``target_spec`` (None: speculation off)."""
    return speculation(spec, target_spec).drafter


def self_layers(spec: str) -> int | list[int] | None:
    """The layers of a ``self:`` spec (a count, or indices); None for any other spec."""
    if not spec.startswith("self:"):
        return None
    body = spec[len("self:") :]
    try:
        return [int(x) for x in body.split(",")] if "," in body else int(body)
    except ValueError as exc:
        raise DrafterError(f"bad drafter spec {spec!r}: use self:N or self:i,j,k") from exc


def borrowed_layers(spec: str, target_spec: str) -> tuple[int, ...]:
    """Indices of the target's decoder layers the drafter of ``spec`` is made of (besides the
    embeddings and LM head every drafter reads): a ``self:`` spec's, an adapter checkpoint's
    over the target; none for a checkpoint that stores its own layers or was initialised from
    another model (``init``), nor without a drafter."""
    resolved = resolve_spec(spec, target_spec)
    if resolved is None:
        return ()
    spec = resolved
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
