"""The replay drafter: a measurement instrument, never a drafter to serve with.

``--drafter replay:TAU[:HIT][:SHAPE]`` proposes the target's own future greedy tokens, recorded
by an ``ar`` run of the same request through the same engine, corrupted so that the accepted
length per round averages TAU (the paper's 7.88 for Qwen3-8B at block 16) and, in ``async``,
the block a round needs was prepared as a branch in a share HIT of the rounds (default the
paper's 0.78). Optionally a drafter of a named shape runs its real forwards beside it, so
drafting costs real time. It separates what the engine turns into speed from how well a trained
drafter would be accepted. Output stays lossless (the target verifies every proposal), it is
never a default, and every output of a replay run names it as an instrument.

- :mod:`~d3d.replay.spec`     the spec and its label
- :mod:`~d3d.replay.schedule` the corruption: error diffusion to TAU and HIT (pure)
- :mod:`~d3d.replay.book`     the recordings
- :mod:`~d3d.replay.drafter`  the instrument in the engine: recording, checks, ``sync``, the link
- :mod:`~d3d.replay.server`   the instrument in the drafter worker (``async``, branches)
- :mod:`~d3d.replay.shape`    the optional drafter shape's real forwards
"""

from d3d.replay.book import ReplayBook
from d3d.replay.drafter import ReplayDrafter, build_replay
from d3d.replay.spec import INSTRUMENT, ReplaySpec, is_replay, parse_replay

__all__ = [
    "INSTRUMENT",
    "ReplayBook",
    "ReplayDrafter",
    "ReplaySpec",
    "build_replay",
    "is_replay",
    "parse_replay",
]
