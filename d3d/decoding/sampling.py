"""Turning logits into probabilities and tokens.

Speculative sampling is exact only if the target's ``p`` and the drafter's ``q`` are the very
distributions tokens are drawn from, so both sides go through :func:`probabilities`. Greedy
decoding never builds probabilities: it takes the argmax of the raw logits, which is what plain
greedy decoding of the target does.

Letters: T positions, V vocab.
"""

from __future__ import annotations

import torch

from d3d.config import SamplingConfig


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature- and top-p-processed distributions: logits [T, V] -> probs [T, V] (fp32)."""
    if cfg.greedy:
        raise ValueError("greedy decoding uses argmax, not probabilities")
    # Shifted by the max first (softmax does not change): a tiny temperature then sends the
    # others far below, never the max to +inf (inf - inf would make the distribution NaN); and
    # never below float32's smallest normal, which a temperature like 1e-300 rounds to 0 (0 / 0).
    x = logits.float()
    t = max(cfg.temperature, torch.finfo(torch.float32).tiny)
    probs = torch.softmax((x - x.amax(dim=-1, keepdim=True)) / t, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it
        # is still below top_p (so the most likely token always stays).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def make_generator(cfg: SamplingConfig, device: torch.device | str) -> torch.Generator | None:
    """A seeded generator for reproducible sampling, or None for greedy / unseeded runs."""
    if cfg.greedy or cfg.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed)
    return gen


def pick(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from one position's logits [V]."""
    if cfg.greedy:
        return int(logits.argmax(dim=-1).item())
    p = probabilities(logits.unsqueeze(0), cfg)[0]
    return int(torch.multinomial(p, 1, generator=generator).item())
