"""Where the drafter runs relative to the target: a pure function of the device specs and cores.

Device specs: ``cpu``, ``cuda``, ``cuda:N``, and for the drafter also ``cpu:CORES`` (``cpu:1``,
``cpu:2-3``, ``cpu:0,2``), which asks for the drafter in its own process pinned to those cores.

- A drafter on a GPU runs in a thread of the engine's process (its kernels run beside the
  target's; a second GPU is a real second device).
- ``cpu:CORES``: its own process on those cores; the target's process keeps the other cores.
- No drafter device on a CPU host with two or more cores: the drafter's process takes the last
  core, the target the others (two single-thread processes on two cores run side by side without
  slowing each other down, as measured here; two threads of one process would share one pool).
- Plain ``cpu``, or a one-core host: a thread beside the target (no overlap to gain; ``auto``
  then finds that speculation does not pay and switches it off).
"""

from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    """A device spec cannot be honoured on this host; the message says why."""


@dataclass(frozen=True)
class Placement:
    kind: str  # "thread" or "process"
    device: str  # the drafter's torch device
    drafter_cores: tuple[int, ...] = ()
    target_cores: tuple[int, ...] = ()


def parse_cores(text: str) -> tuple[int, ...]:
    """``"1"``, ``"2-3"``, ``"0,2,5-6"`` -> sorted distinct core ids."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cores.update(range(lo, hi + 1))
            elif part.strip():
                cores.add(int(part))
    except ValueError:
        raise PlacementError(f"bad core list {text!r}: use cpu:1, cpu:2-3 or cpu:0,2") from None
    if not cores or min(cores) < 0:
        raise PlacementError(f"bad core list {text!r}: use cpu:1, cpu:2-3 or cpu:0,2")
    return tuple(sorted(cores))


def torch_device(spec: str) -> str:
    """The torch device of a spec (``cpu:1`` is the CPU, in a process of its own)."""
    return "cpu" if spec.startswith("cpu") else spec


def resolve_placement(
    target_device: str, drafter_device: str | None, cores: list[int] | tuple[int, ...]
) -> Placement:
    """Decide where the drafter worker runs (see the module docstring)."""
    dev = drafter_device or ""
    if dev.startswith("cuda") or (not dev and not target_device.startswith("cpu")):
        return Placement("thread", dev or target_device)
    if dev.startswith("cpu:"):
        want = parse_cores(dev[4:])
        missing = [c for c in want if c not in cores]
        if missing:
            raise PlacementError(
                f"drafter device {dev!r}: core(s) {missing} are not available (this process "
                f"may use {list(cores)})"
            )
        rest = tuple(c for c in cores if c not in want)
        return Placement("process", "cpu", want, rest)
    if dev == "cpu" or len(cores) < 2:
        return Placement("thread", "cpu")
    return Placement("process", "cpu", (cores[-1],), tuple(cores[:-1]))
