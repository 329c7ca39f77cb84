"""What ``--drafter replay:TAU[:HIT][:SHAPE]`` names: the replay instrument's settings.

``TAU`` is the mean acceptance length per round to replay (tokens per round, the target's own
token included: the paper's 7.88 for Qwen3-8B at block 16); ``HIT`` the share of ``async``
rounds whose block a prepared branch serves (default the paper's 0.78); ``SHAPE`` an optional
drafter whose real forwards run beside the replay so that drafting costs real time: any drafter
spec (``self:N``, ``self:i,j``, a checkpoint folder, ``default``) or ``shape=CONFIG[@LAYERS]``,
random weights of a model config (a shipped name under ``d3d/configs`` such as ``qwen3-8b``, or a
``config.json``) cut to LAYERS layers. Examples: ``replay:7.88``, ``replay:7.88:0.78:self:4``,
``replay:7.88:shape=qwen3-8b@31``.

This module is pure (no torch): the CLI, the planner and the drafter's loader all read specs
through :func:`parse_replay`.
"""

from __future__ import annotations

from dataclasses import dataclass

from d3d.model.meta import DrafterError

PREFIX = "replay:"
DEFAULT_HIT = 0.78  # the paper's branch cache hit rate (AIME25, Qwen3-8B)
INSTRUMENT = "measurement instrument"


def is_replay(spec: str | None) -> bool:
    """Whether a drafter spec names the replay instrument."""
    return bool(spec) and str(spec).startswith(PREFIX)


@dataclass(frozen=True)
class ReplaySpec:
    """The replay instrument's settings (see the module docstring)."""

    tau: float
    hit: float = DEFAULT_HIT
    shape: str | None = None

    def __post_init__(self) -> None:
        if not self.tau >= 1.0:
            raise DrafterError(f"replay: TAU must be >= 1 (tokens per round), got {self.tau}")
        if not 0.0 <= self.hit <= 1.0:
            raise DrafterError(f"replay: HIT must be in [0, 1], got {self.hit}")
        if self.shape is not None and not self.shape.strip():
            raise DrafterError("replay: the drafter shape after TAU and HIT is empty")

    def check_block(self, block_size: int) -> None:
        """A round yields at most a whole block: TAU <= B."""
        if self.tau > block_size:
            raise DrafterError(
                f"replay: TAU {self.tau} exceeds the block size {block_size} "
                "(a round yields at most a block of tokens)"
            )

    @property
    def text(self) -> str:
        """The canonical spec, HIT written out."""
        shape = f":{self.shape}" if self.shape else ""
        return f"{PREFIX}{self.tau:g}:{self.hit:g}{shape}"

    @property
    def label(self) -> str:
        """How every output that reports a replay run names it."""
        return f"{self.text} ({INSTRUMENT})"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_replay(spec: str) -> ReplaySpec:
    """``replay:TAU[:HIT][:SHAPE]`` -> :class:`ReplaySpec` (DrafterError naming the problem)."""
    if not is_replay(spec):
        raise DrafterError(f"not a replay spec: {spec!r}")
    parts = spec[len(PREFIX) :].split(":")
    tau = _number(parts[0])
    if tau is None:
        raise DrafterError(
            f"bad drafter spec {spec!r}: use replay:TAU[:HIT][:SHAPE], e.g. replay:7.88"
        )
    rest = parts[1:]
    hit = _number(rest[0]) if rest else None
    if hit is not None:
        rest = rest[1:]
    shape = ":".join(rest) if rest else None
    return ReplaySpec(tau, DEFAULT_HIT if hit is None else hit, shape)
