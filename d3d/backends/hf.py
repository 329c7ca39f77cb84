"""Small shims over Hugging Face transformers version differences.

The KV cache argument is ``past_key_values`` up to transformers 5.x and ``cache`` in newer
releases (where the old name warns, and is dropped in 5.40); on 4.x ``cache=`` is silently
ignored. :func:`with_cache` picks the name the model's ``forward`` declares. Rolling a cache
back uses ``crop(-n)`` for n > 0 only: ``crop(0)`` empties the cache on 4.x and a positive
argument raises on 5.x.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn
from transformers import DynamicCache


@functools.lru_cache(maxsize=64)
def _cache_arg(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(module: nn.Module, cache: DynamicCache) -> dict:
    """Keyword arguments that hand ``cache`` to ``module.forward`` on any transformers version."""
    return {_cache_arg(type(module)): cache, "use_cache": True}


def trim_cache(cache: DynamicCache, n: int) -> None:
    """Drop the last n positions of a cache; n == 0 is a no-op."""
    if n > 0:
        cache.crop(-n)


def cache_length(cache: DynamicCache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())
