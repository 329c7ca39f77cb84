"""Batched serving: many requests share each target forward (continuous batching).

- :mod:`d3d.batching.cache`     a KV cache with one length per row (independent growth and rollback)
- :mod:`d3d.batching.target`    one target forward over rows of different lengths
- :mod:`d3d.batching.policy`    whether a step speculates, from measured costs
- :mod:`d3d.batching.request`   what callers submit, and the per-row state
- :mod:`d3d.batching.scheduler` the step loop: admit + prefill, one round for all rows, finish
"""

from d3d.batching.policy import CostModel, decide
from d3d.batching.request import GenRequest
from d3d.batching.scheduler import BatchEngine

__all__ = ["BatchEngine", "CostModel", "GenRequest", "decide"]
