"""Speculative sampling reproduces the target's distribution (chi-square over many seeds).

A tiny 5-token vocabulary makes the exact distribution of a 3-token continuation enumerable
(125 sequences): it is computed from the target's own probabilities and compared with the
sequences that ``sync`` sampling emits, with a drafter whose q is far from p.

The samples are drawn as rows of one scheduler (:func:`sample_many`, also used by the other
modes' distribution tests): the same scheduler, proposers and acceptance as one request at a
time (``decode`` is a one-row scheduler), with a fraction of the forwards.
"""

import itertools
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from d3d.config import DecodeConfig, SamplingConfig
from d3d.decoding.proposers import Proposer, SyncProposer
from d3d.engine import GenRequest, Scheduler, decode
from d3d.model.drafter import D3DDrafter
from d3d.sampling import probabilities
from tests.conftest import tiny_engine, tiny_model

V, N_NEW, PROMPT = 5, 3, [1, 3, 2]
ROWS = 16  # requests decoding at once


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


def foreign_drafter() -> D3DDrafter:
    """A drafter from other weights, sharpened so its q disagrees strongly with the target's p."""
    return D3DDrafter.from_target(tiny_model("llama", seed=11, vocab=V, scale=6.0), 2, block_size=4)


def draw(
    target,
    mode: str,
    sampling_kw: dict,
    n: int,
    drafter: D3DDrafter | None = None,
    proposer: Callable[[], Proposer] | None = None,
) -> list[tuple[int, ...]]:
    """The continuations of PROMPT from ``n`` sampled requests, request i seeded with i, decoded
    as rows of one scheduler, ROWS at once (a request joins as soon as one ends): the engine's
    over ``target`` and ``drafter`` with its proposer for ``mode``, or, given ``proposer``, one
    giving each row a new ``proposer()``. A row draws only from generators seeded by its own
    seed, so the rows are independent samples
    (:func:`test_rows_of_a_batch_draw_what_they_would_draw_alone`). Checks that no row failed
    and that a speculative mode's drafts were both accepted and rejected."""
    engine = None
    if proposer is None:
        engine = tiny_engine(target, drafter)
        sched = engine.scheduler(max_batch=ROWS)
        sched.eos_ids = set()
    else:
        sched = Scheduler(target, set(), lambda _req: proposer(), block_size=4, max_batch=ROWS,
                          max_kv_tokens=64 * ROWS)  # fmt: skip
    outs: list[list[int]] = [[] for _ in range(n)]
    ended: list = []
    seeds = iter(range(n))
    try:
        while True:
            for seed in itertools.islice(seeds, ROWS - len(sched.rows) - len(sched.waiting)):
                sampling = SamplingConfig(seed=seed, **sampling_kw)
                sched.add(GenRequest(PROMPT, N_NEW, sampling, mode, on_tokens=outs[seed].extend,
                                     on_finish=lambda st, err: ended.append((st, err))))  # fmt: skip
            if sched.idle:
                break
            sched.step()
    finally:
        if engine is not None:
            engine.close()
    assert len(ended) == n and all(err is None and not st.worker_failures for st, err in ended)
    drafted = sum(st.num_draft_tokens for st, _ in ended)
    accepted = sum(st.num_accepted_tokens for st, _ in ended)
    assert mode == "ar" or 0 < accepted < drafted, (mode, accepted, drafted)
    return [tuple(out) for out in outs]


def sample_many(target, mode, sampling_kw, n, drafter=None, proposer=None):
    """How often each continuation came out of :func:`draw`'s ``n`` requests."""
    return dict(Counter(draw(target, mode, sampling_kw, n, drafter, proposer)))


@pytest.mark.parametrize("sampling_kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_sync_sampling_matches_target_distribution(sampling_kw):
    """``sync`` rows emit the target's distribution although the drafter's q is far from p."""
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    exact = exact_distribution(target, SamplingConfig(**sampling_kw))
    n = 2000
    counts = sample_many(target, "sync", sampling_kw, n, drafter=foreign_drafter())
    stat, df = chi_square(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)


def test_chi_square_detects_a_wrong_distribution():
    """The tests above can fail: plain sampling at another temperature is rejected."""
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    exact = exact_distribution(target, SamplingConfig(temperature=1.0))
    n = 2000
    counts = sample_many(target, "ar", {"temperature": 0.6}, n)
    stat, df = chi_square(counts, exact, n)
    assert stat > chi2_critical(df), (stat, df)


def test_rows_of_a_batch_draw_what_they_would_draw_alone():
    """A row's samples do not depend on the rows beside it: each seed's ``sync`` tokens as a
    row of a batch (:func:`draw`) are those it draws alone through ``decode``, so the batched
    samples above are as independent as samples drawn one request at a time."""
    target, drafter = tiny_model("llama", seed=3, vocab=V, scale=3.0), foreign_drafter()
    kw, n = {"temperature": 1.0}, 48
    alone = []
    for seed in range(n):
        cfg = DecodeConfig(mode="sync", max_new_tokens=N_NEW, block_size=4,
                           sampling=SamplingConfig(seed=seed, **kw))  # fmt: skip
        chunks = decode(target, SyncProposer(drafter), PROMPT, cfg, set())
        alone.append(tuple(t for chunk in chunks for t in chunk))
    assert draw(target, "sync", kw, n, drafter=drafter) == alone
    assert len(set(alone)) > n // 4  # the seeds do give different samples
