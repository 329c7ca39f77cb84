"""The engine: one scheduler that every caller decodes through.

- :mod:`d3d.engine.front`     the loaded target and drafter, host costs, text in / out
- :mod:`d3d.engine.loading`   devices checked, the drafter built from its spec
- :mod:`d3d.engine.drafter_host` the drafter worker's life and the CPU budget it leaves
- :mod:`d3d.engine.scheduler` ``step()``: admit, propose, verify, accept, emit, read prompts
- :mod:`d3d.backends.target`    one target forward over rows of different lengths
- :mod:`d3d.backends.kv`        the target's KV, per row, and its budget
- :mod:`d3d.engine.request`   what callers submit, and the per-row state
- :mod:`d3d.engine.stream`    one request stepped in the caller's thread (CLI, harnesses, tests)
"""

from d3d.backends.kv import KvLimitError
from d3d.engine.front import Engine, Generation
from d3d.engine.loading import DrafterFactory, build_drafter, check_device, placement_for
from d3d.engine.request import GenRequest
from d3d.engine.scheduler import PrefillBudget, Scheduler
from d3d.engine.stream import decode, stream

__all__ = [
    "DrafterFactory",
    "Engine",
    "GenRequest",
    "Generation",
    "KvLimitError",
    "PrefillBudget",
    "Scheduler",
    "build_drafter",
    "check_device",
    "decode",
    "placement_for",
    "stream",
]
