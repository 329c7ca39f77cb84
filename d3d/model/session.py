"""Per-request drafting state: a drafter's cache of committed tokens and its sampling rule.

A :class:`DraftSession` holds one request's drafter KV cache. Invariant: the cache holds the
committed tokens except the last one (the next anchor). :meth:`DraftSession.draft` takes the
whole committed sequence and reuses the longest cached prefix, so the caller only ever passes
token ids; the drafter's own forwards (:meth:`d3d.model.drafter.D3DDrafter.block_scores`) do the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from d3d.backends.hf import trim_cache
from d3d.config import SamplingConfig
from d3d.sampling import probabilities


class BlockDrafter(Protocol):
    """What a session needs of its drafter (:class:`d3d.model.drafter.D3DDrafter`)."""

    def block_scores(
        self, anchor: int, cache: DynamicCache, pending: Sequence[int] = ()
    ) -> torch.Tensor: ...

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor: ...

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor: ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def rewind(
    cache: DynamicCache, cached_ids: list[int], want: list[int]
) -> tuple[DynamicCache, list[int], list[int]]:
    """Cut a cache of ``cached_ids`` back to its longest prefix shared with ``want``.

    Returns the cache (a fresh one when nothing is shared), the ids it now holds, and the ids
    of ``want`` it still lacks.
    """
    common = common_prefix(cached_ids, want)
    if common == 0 and cached_ids:
        cache = DynamicCache()
    else:
        trim_cache(cache, len(cached_ids) - common)
    return cache, want[:common], want[common:]


@dataclass(frozen=True)
class Draft:
    """One drafted block: ``tokens`` [K] ids, and ``q`` [K, V] probabilities when sampling."""

    tokens: torch.Tensor
    q: torch.Tensor | None


class DraftSession:
    """Per-request drafting state: the cache of committed tokens, and the sampling rule.

    Invariant: the cache holds the committed tokens except the last one (the next anchor).
    ``draft`` takes the whole committed sequence and reuses the longest cached prefix, so the
    caller only ever passes token ids.
    """

    def __init__(
        self,
        drafter: BlockDrafter,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
    ):
        self.drafter = drafter
        self.sampling = sampling or SamplingConfig()
        self.generator = generator
        self.cache = DynamicCache()
        self.cached_ids: list[int] = []

    def _rewind(self, want: list[int]) -> list[int]:
        """Cut the cache back to its longest prefix shared with ``want``; return the rest."""
        self.cache, self.cached_ids, pending = rewind(self.cache, self.cached_ids, want)
        return pending

    @torch.inference_mode()
    def draft(self, token_ids: Sequence[int]) -> Draft:
        """Draft K = B-1 tokens after ``token_ids`` (the committed sequence, anchor last)."""
        if not token_ids:
            raise ValueError("drafting needs at least one committed token (the anchor)")
        want = [int(t) for t in token_ids[:-1]]
        pending = self._rewind(want)
        scores = self.drafter.block_scores(int(token_ids[-1]), self.cache, pending)
        self.cached_ids = want
        if self.sampling.greedy:
            return Draft(tokens=self.drafter.to_target_ids(scores.argmax(dim=-1)), q=None)
        q = probabilities(self.drafter.full_logits(scores), self.sampling)
        tokens = torch.multinomial(q, 1, generator=self.generator).squeeze(-1)
        return Draft(tokens=tokens, q=q)
