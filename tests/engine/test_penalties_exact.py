"""Penalties, ``min_tokens``, ``ignore_eos`` and stop ids stay exact under speculation.

Greedy: every mode's output (``ar``, ``sync``, ``async``, copy rounds) equals plain greedy
decoding with the same penalties, recomputed from scratch the obvious way (a full forward per
token, the penalties written out per token). A drafter that proposes that very continuation has
its whole block accepted only if each verified position is penalised with its own history,
drafts before it included. Sampling: chi-square over 2,000 seeds against the exact penalised
distribution of a 3-token continuation over a 5-token vocabulary (the machinery of
tests/engine/test_sampling_exact.py), for ``sync``, ``async`` and copy rounds; the same counts
are rejected against the unpenalised distribution, so the test can tell the two apart.
Logprobs: each emitted token's is the penalised distribution's at that point.
"""

from __future__ import annotations

import pytest
import torch

from d3d.config import DecodeConfig, SamplingConfig
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.decoding.stats import DecodeStats
from d3d.engine import decode
from d3d.engine.request import GenRequest
from d3d.engine.scheduler import Scheduler
from d3d.engine.stream import stream
from d3d.model.drafter import D3DDrafter
from d3d.sampling import log_distribution, probabilities
from d3d.worker import AsyncProposer
from tests.concurrency.fakes import ScriptedWorker
from tests.conftest import TINY_VOCAB, ScriptDrafter, greedy_continuation, tiny_model
from tests.engine.test_copy_lossless import copy_rounds, copying_auto
from tests.engine.test_sampling_exact import (
    PROMPT,
    V,
    chi2_critical,
    chi_square,
    foreign_drafter,
    sample_many,
)

PROMPTS = [[1, 5, 9, 22, 7], list(range(2, 30))]
N = 30


def processed(logits: torch.Tensor, prompt, out, cfg: SamplingConfig, stops) -> torch.Tensor:
    """One position's logits [V] with the penalties written out token by token."""
    x = logits.clone().float()
    for t in set(prompt) | set(out):
        r = cfg.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):
        x[t] -= cfg.frequency_penalty * out.count(t) + cfg.presence_penalty
    if len(out) < cfg.min_tokens:
        x[sorted(stops)] = float("-inf")
    return x


def next_logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([list(ids)])).logits[0, -1]


def reference(model, prompt, cfg: SamplingConfig, eos: set[int], n: int = N) -> list[int]:
    """Plain greedy decoding with penalties, from scratch."""
    stops, out = cfg.stops(eos), []
    while len(out) < n and not (out and out[-1] in stops):
        x = processed(next_logits(model, prompt + out), prompt, out, cfg, stops)
        out.append(int(x.argmax()))
    return out


def run(model, proposer, prompt, cfg: SamplingConfig, eos: set[int], n: int = N):
    stats = DecodeStats(mode=proposer.name)
    dc = DecodeConfig(mode=proposer.name, max_new_tokens=n, sampling=cfg)
    return [t for c in decode(model, proposer, prompt, dc, eos, stats) for t in c], stats


PENALTIES = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency+presence": dict(frequency_penalty=0.9, presence_penalty=0.4),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.3),
}
MODES = ["ar", "sync", "sync-oracle", "async", "async-oracle", "copy"]


def proposer_for(mode, target, prompt, ref, thread_workers):
    if mode == "ar":
        return ArProposer()
    if mode == "sync":
        return SyncProposer(D3DDrafter.from_target(target, 1))
    if mode == "sync-oracle":
        return SyncProposer(ScriptDrafter(prompt, ref))
    if mode == "async":
        return AsyncProposer(thread_workers(D3DDrafter.from_target(target, 1)), TINY_VOCAB)
    if mode == "async-oracle":
        return AsyncProposer(ScriptedWorker(ScriptDrafter(prompt, ref), ["hit"]), TINY_VOCAB)
    return copying_auto(target, TINY_VOCAB, drafter=False)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_greedy_with_penalties_equals_plain_greedy_with_them(
    tiny_target, penalty, mode, thread_workers
):
    cfg = SamplingConfig(**PENALTIES[penalty])
    changed = 0
    for prompt in PROMPTS:
        ref = reference(tiny_target, prompt, cfg, set())
        changed += ref != greedy_continuation(tiny_target, prompt, N)
        out, stats = run(tiny_target, proposer_for(mode, tiny_target, prompt, ref, thread_workers),
                         prompt, cfg, set())  # fmt: skip
        assert out == ref
        if mode.endswith("oracle"):  # every draft accepted: the prefill's token, 15 + bonus, 13
            assert stats.num_drafts == 2 and stats.num_accepted_tokens == N - 2
    assert changed, "the penalty changed no output: the test would prove nothing"


def fresh(seq: list[int], start: int) -> int:
    """The first token at or after ``start`` that did not occur before it."""
    return next(t for i, t in enumerate(seq) if i >= start and t not in seq[:i])


@pytest.mark.parametrize("mode", ["ar", "sync-oracle", "async", "copy"])
def test_min_tokens_ignore_eos_and_stop_ids(tiny_target, mode, thread_workers):
    prompt, base = PROMPTS[1], {"frequency_penalty": 0.8}  # tiny models loop without a penalty
    free = reference(tiny_target, prompt, SamplingConfig(**base), set())
    eos_at = free.index(fresh(free, 2))
    eos, stop = {free[eos_at]}, fresh(free, eos_at + 4)
    cases = [
        SamplingConfig(**base),  # EOS ends the answer early
        SamplingConfig(**base, min_tokens=eos_at + 3),  # ... not before min_tokens
        SamplingConfig(**base, ignore_eos=True),  # ... not at all
        SamplingConfig(**base, ignore_eos=True, stop_token_ids=(stop,)),  # a stop id instead
        SamplingConfig(**base, min_tokens=N - 2, stop_token_ids=(stop,)),
    ]
    lengths = []
    for cfg in cases:
        ref = reference(tiny_target, prompt, cfg, eos)
        out, stats = run(tiny_target, proposer_for(mode, tiny_target, prompt, ref, thread_workers),
                         prompt, cfg, eos)  # fmt: skip
        assert out == ref, cfg
        assert stats.stop_reason == ("eos" if len(ref) < N else "length")
        lengths.append(len(ref))
    assert lengths[0] == eos_at + 1 and lengths[2] == N and len(set(lengths)) >= 3, lengths


def test_greedy_logprobs_are_the_penalised_distribution_at_every_token(tiny_target):
    prompt, cfg = PROMPTS[0], SamplingConfig(repetition_penalty=1.5, frequency_penalty=0.3)
    ref = reference(tiny_target, prompt, cfg, set(), n=20)
    for proposer in (ArProposer(), SyncProposer(ScriptDrafter(prompt, ref))):
        sched = Scheduler(tiny_target, set(), lambda _r, p=proposer: p, max_batch=2)
        got: list = []
        req = GenRequest(list(prompt), 20, cfg, proposer.name, logprobs=3, on_logprobs=got.extend)
        assert [t for c in stream(sched, req) for t in c] == ref
        assert [lp.token for lp in got] == ref
        for i, lp in enumerate(got):
            x = processed(next_logits(tiny_target, prompt + ref[:i]), prompt, ref[:i], cfg, ())
            want = log_distribution(x[None], cfg)[0]
            assert lp.logprob == pytest.approx(float(want[ref[i]]), abs=1e-4)
            assert [t for t, _ in lp.top] == want.topk(3).indices.tolist()


# ----- sampling: the exact penalised distribution --------------------------------------------
def exact(model, cfg: SamplingConfig, n: int = 3) -> dict[tuple[int, ...], float]:
    """Every continuation's probability under ``cfg`` (stops end a sequence early)."""
    dist: dict[tuple[int, ...], float] = {}
    stops = cfg.stops(set())

    def walk(out: list[int], prob: float) -> None:
        if len(out) == n or (out and out[-1] in stops):
            dist[tuple(out)] = prob
            return
        x = processed(next_logits(model, PROMPT + out), PROMPT, out, cfg, stops)
        p = probabilities(x[None], cfg)[0]
        for t in range(V):
            if p[t] > 0:
                walk([*out, t], prob * float(p[t]))

    walk([], 1.0)
    return dist


SAMPLED = [
    dict(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.8, presence_penalty=0.4),
    dict(temperature=0.8, top_k=4, min_p=0.02, repetition_penalty=1.6, presence_penalty=0.8,
         min_tokens=1, stop_token_ids=(4,)),
]  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async", "copy"])
@pytest.mark.parametrize("kw", SAMPLED, ids=["penalties", "penalties+truncation+stops"])
def test_sampling_with_penalties_keeps_the_penalised_distribution(mode, kw):
    """Each mode's samples follow the penalised distribution and are told apart from the
    unpenalised one."""
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    n = 2000
    if mode == "copy":
        counts = sample_many(target, "auto", kw, n, proposer=copy_rounds(target))
    else:
        counts = sample_many(target, mode, kw, n, drafter=foreign_drafter())
    stat, df = chi_square(counts, exact(target, SamplingConfig(**kw)), n)
    assert stat < chi2_critical(df), (stat, df)
    plain = {k: v for k, v in kw.items() if "penalty" not in k}
    stat, df = chi_square(counts, exact(target, SamplingConfig(**plain)), n)
    assert stat > chi2_critical(df), ("indistinguishable from no penalty", stat, df)
