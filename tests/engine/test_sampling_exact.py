"""Speculative sampling reproduces the target's distribution (chi-square over many seeds).

A tiny 5-token vocabulary makes the exact distribution of a 3-token continuation enumerable
(125 sequences): it is computed from the target's own probabilities and compared with the
sequences that ``sync`` sampling emits, with a drafter whose q is far from p.
"""

import itertools
import math

import pytest
import torch

from d3d.config import DecodeConfig, SamplingConfig
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.engine import decode
from d3d.model.drafter import D3DDrafter
from d3d.sampling import probabilities
from tests.conftest import tiny_model

V, N_NEW, PROMPT = 5, 3, [1, 3, 2]


def exact_distribution(model, sampling):
    dist = {}
    with torch.inference_mode():
        for seq in itertools.product(range(V), repeat=N_NEW):
            ids = torch.tensor([PROMPT + list(seq)])
            p = probabilities(model(ids).logits[0, len(PROMPT) - 1 : -1], sampling)
            dist[seq] = float(torch.prod(p[torch.arange(N_NEW), torch.tensor(seq)]))
    return dist


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(counts, expected_p, n):
    """Chi-square statistic with cells of expected count < 5 pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in expected_p.items():
        e, o = p * n, counts.get(seq, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    return stat, cells - 1


def sample_many(model, proposer, sampling_kw, n):
    counts = {}
    for seed in range(n):
        cfg = DecodeConfig(
            mode=proposer.name,
            max_new_tokens=N_NEW,
            block_size=4,
            sampling=SamplingConfig(seed=seed, **sampling_kw),
        )
        seq = tuple(t for chunk in decode(model, proposer, PROMPT, cfg, set()) for t in chunk)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.parametrize("sampling_kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_sync_sampling_matches_target_distribution(sampling_kw):
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    # A drafter from different weights, sharpened so its q disagrees strongly with p.
    drafter = D3DDrafter.from_target(
        tiny_model("llama", seed=11, vocab=V, scale=6.0), 2, block_size=4
    )
    exact = exact_distribution(target, SamplingConfig(**sampling_kw))
    n = 2000
    counts = sample_many(target, SyncProposer(drafter), sampling_kw, n)
    stat, df = chi_square(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: plain sampling at another temperature is rejected."""
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    exact = exact_distribution(target, SamplingConfig(temperature=1.0))
    n = 2000
    counts = sample_many(target, ArProposer(), {"temperature": 0.6}, n)
    stat, df = chi_square(counts, exact, n)
    assert stat > chi2_critical(df), (stat, df)
