"""Turning logits into probabilities, tokens and reported log-probabilities.

Speculative sampling is exact only if the target's ``p`` and the drafter's ``q`` are the very
distributions tokens are drawn from, so both sides go through :func:`probabilities`. Greedy
decoding never builds probabilities: it takes the argmax of the logits, which is what plain
greedy decoding of the target does. Penalties, which read a row's history, are applied to the
target's logits before either (:mod:`d3d.decoding.processors`); the drafter's q needs none of
them, since the ratio test is exact for any q.

The order is vLLM's: temperature, then ``min_p``, ``top_k``, ``top_p``, each on what the one
before kept (renormalised).

It sits beside :mod:`d3d.config`, below the model layer: the drafter's session draws its
proposal distribution q with it, and the decoding layer its p.

Letters: T positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d3d.config import SamplingConfig

LOGPROB_FLOOR = -9999.0  # what a token of probability 0 reports (JSON has no -inf; vLLM's value)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature-, min-p-, top-k- and top-p-processed distributions: logits [T, V] -> probs
    [T, V] (fp32)."""
    if cfg.greedy:
        raise ValueError("greedy decoding uses argmax, not probabilities")
    # Shifted by the max first (softmax does not change): a tiny temperature then sends the
    # others far below, never the max to +inf (inf - inf would make the distribution NaN); and
    # never below float32's smallest normal, which a temperature like 1e-300 rounds to 0 (0 / 0).
    x = logits.float()
    t = max(cfg.temperature, torch.finfo(torch.float32).tiny)
    probs = torch.softmax((x - x.amax(dim=-1, keepdim=True)) / t, dim=-1)
    if cfg.min_p > 0.0:
        floor = cfg.min_p * probs.amax(dim=-1, keepdim=True)
        probs = _renorm(probs.masked_fill(probs < floor, 0.0))
    if 0 < cfg.top_k < probs.shape[-1]:
        kth = probs.topk(cfg.top_k, dim=-1).values[..., -1:]
        # Ties at the k-th value stay (no arbitrary choice among equal tokens).
        probs = _renorm(probs.masked_fill(probs < kth, 0.0))
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it
        # is still below top_p. The most likely token always stays, also for a top_p that
        # float32 rounds to 0 (5e-324: every mass before would reach it, and 0 / 0 is NaN).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop = before >= cfg.top_p
        drop[..., 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = _renorm(torch.zeros_like(probs).scatter(-1, order, sorted_p))
    return probs


def _renorm(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


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


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the ``top`` most likely tokens' (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_distribution(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The log of the distribution the tokens are chosen from: logits [T, V] -> [T, V].

    Sampling: the processed ``p`` (:func:`probabilities`; a token cut by top-k / top-p / min-p
    has -inf). Greedy: the softmax of the (penalised) logits at temperature 1, whose argmax is
    the greedy token.
    """
    if cfg.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(probabilities(logits, cfg))


def token_logprobs(logp: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each position's emitted token with its log-probability and the ``top`` most likely
    alternatives: logp [T, V] (:func:`log_distribution`), ``tokens`` [T]."""
    floor = lambda x: max(float(x), LOGPROB_FLOOR)  # noqa: E731
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, device=logp.device)].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if top > 0:
        vals, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops = [
            tuple((int(i), floor(v)) for i, v in zip(ri, rv, strict=True))
            for ri, rv in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
    return [TokenLogprob(t, floor(c), tp) for t, c, tp in zip(tokens, chosen, tops, strict=True)]
