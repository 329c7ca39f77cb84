"""Logits processing that reads a row's history: penalties and ``min_tokens``.

A penalty changes the target's distribution, so acceptance must test drafts against the
changed one, and inside a verified block each position has its own history: the logits at
position j of ``[anchor, d_1..d_K]`` predict the token after d_j, so its penalties count
d_1..d_j as output already written (and ``min_tokens`` counts them too). :func:`process` builds
every position's counts in one scatter and processes the [K+1, V] logits at once; each row of
its result is exactly what plain decoding would have processed at that point, so greedy
acceptance on it is plain greedy decoding with penalties and the ratio test on its
probabilities is exact (the drafter's q needs no penalty: the test is exact for any q).

The rules are vLLM's: ``repetition_penalty`` r divides a positive logit by r and multiplies a
negative one by r, for every token seen in the prompt or the output; ``frequency_penalty`` f
and ``presence_penalty`` e subtract ``f * count + e * (count > 0)``, counting the output only;
``min_tokens`` m sets the stop tokens' logits to -inf while fewer than m tokens were written.

Letters: T positions (K+1), K draft length, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d3d.config import SamplingConfig


def process(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    counts: torch.Tensor,
    seen: torch.Tensor,
    written: int,
    drafts: torch.Tensor,
    stops: Sequence[int] = (),
) -> torch.Tensor:
    """Penalised logits [T, V] (fp32) for positions 0..T-1 of a block.

    logits [T, V]; ``counts`` [V] occurrences of each token in the output before position 0;
    ``seen`` [V] bool, in the prompt or that output; ``written``: output tokens before position
    0; ``drafts`` [T-1]: the block's draft tokens (position j has seen ``drafts[:j]``);
    ``stops``: the ids ``min_tokens`` holds back.
    """
    t, v = logits.shape
    x = logits.float().clone()
    if cfg.penalised:
        c = counts.to(x.device, torch.float32).expand(t, v).clone()  # [T, V]
        if t > 1:
            # (j, i) with i < j: position j has seen draft i.
            j, i = torch.tril_indices(t, t - 1, offset=-1, device=x.device)
            c.index_put_((j, drafts.to(x.device)[i]), torch.ones_like(j, dtype=c.dtype), True)
        if cfg.repetition_penalty != 1.0:
            r = cfg.repetition_penalty
            hit = seen.to(x.device).expand(t, v) | (c > 0)
            x = torch.where(hit, torch.where(x > 0, x / r, x * r), x)
        x = x - cfg.frequency_penalty * c - cfg.presence_penalty * (c > 0).float()
    if cfg.min_tokens > written and stops:
        short = torch.arange(t, device=x.device) + written < cfg.min_tokens  # [T]
        ids = torch.tensor(sorted(stops), device=x.device)
        x[short.nonzero()[:, 0:1], ids] = float("-inf")
    return x


class History:
    """What a row's penalties read: its output counts, the tokens it has seen, how many it has
    written. The scheduler keeps one per row that needs it (:func:`History.of`) and tells it
    every committed token; the tensors are built on first use, at the logits' width and device.
    """

    def __init__(self, cfg: SamplingConfig, prompt_ids: Sequence[int], stops: set[int]):
        self.cfg = cfg
        self.stops = sorted(stops)
        self.written = 0
        self._prompt = list(prompt_ids)
        self._pending: list[int] = []
        self.counts: torch.Tensor | None = None  # [V] float32
        self.seen: torch.Tensor | None = None  # [V] bool

    @classmethod
    def of(cls, cfg: SamplingConfig, prompt_ids: Sequence[int], stops: set[int]) -> History | None:
        """A history for a row whose logits depend on it; None when they do not."""
        if cfg.penalised or (cfg.min_tokens > 0 and stops):
            return cls(cfg, prompt_ids, stops)
        return None

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens the row has written (emitted output)."""
        self.written += len(tokens)
        self._pending += tokens

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The block's logits [T, V] processed for its positions (:func:`process`)."""
        v, device = logits.shape[-1], logits.device
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(v, device=device)
            self.seen = torch.zeros(v, dtype=torch.bool, device=device)
            self.seen[torch.tensor(self._prompt, dtype=torch.long, device=device)] = True
        if self._pending:
            ids = torch.tensor(self._pending, dtype=torch.long, device=device)
            self.counts.index_add_(0, ids, torch.ones(len(self._pending), device=device))
            self.seen[ids] = True
            self._pending = []
        written = self.written
        return process(logits, self.cfg, self.counts, self.seen, written, drafts, self.stops)
