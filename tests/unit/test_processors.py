"""Penalties, min_tokens, the new truncations and logprobs, checked against plain references.

The reference for penalties is written out per position the obvious way (a loop over the
tokens seen so far, drafts before the position included); repetition is also checked against
Hugging Face's own ``RepetitionPenaltyLogitsProcessor``.
"""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from d3d.config import ConfigError, SamplingConfig
from d3d.decoding.processors import History, process
from d3d.decoding.verify import accept
from d3d.sampling import LOGPROB_FLOOR, log_distribution, probabilities, token_logprobs

V = 12


def naive(row: torch.Tensor, prompt: list[int], out: list[int], cfg: SamplingConfig, stops=()):
    """One position's logits [V] penalised for a history: the prompt and the output so far."""
    x = row.clone().float()
    for t in set(prompt) | set(out):
        r = cfg.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):
        x[t] -= cfg.frequency_penalty * out.count(t) + cfg.presence_penalty
    if len(out) < cfg.min_tokens:
        for s in stops:
            x[s] = float("-inf")
    return x


def counts_of(out: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.zeros(V)
    for t in out:
        c[t] += 1
    return c, c > 0


CFGS = [
    SamplingConfig(repetition_penalty=1.7),
    SamplingConfig(repetition_penalty=0.6),
    SamplingConfig(frequency_penalty=0.8),
    SamplingConfig(presence_penalty=-0.9),
    SamplingConfig(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.5),
    SamplingConfig(min_tokens=4, frequency_penalty=0.2),
]


@pytest.mark.parametrize("cfg", CFGS)
def test_every_position_is_penalised_with_its_own_history(cfg):
    torch.manual_seed(0)
    prompt, out, drafts = [1, 2, 2, 7], [3, 3, 5], [5, 9, 3, 5]
    logits = torch.randn(len(drafts) + 1, V) * 3
    counts, seen = counts_of(out)
    seen[prompt] = True
    got = process(logits, cfg, counts, seen, len(out), torch.tensor(drafts), stops=[11])
    for j in range(len(drafts) + 1):
        want = naive(logits[j], prompt, out + drafts[:j], cfg, stops=[11])
        assert torch.allclose(got[j], want, atol=1e-5), j
    # The drafts matter: ignoring them (every position with the history of position 0) differs.
    blind = [naive(logits[j], prompt, out, cfg, stops=[11]) for j in range(len(drafts) + 1)]
    assert not torch.allclose(torch.stack(blind), got, atol=1e-3)


def test_repetition_matches_hugging_face():
    torch.manual_seed(1)
    prompt, out = [1, 4, 4], [6, 8, 1]
    logits = torch.randn(1, V) * 2
    hf = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([prompt + out]), logits.clone())
    counts, seen = counts_of(out)
    seen[prompt] = True
    got = process(logits, SamplingConfig(repetition_penalty=1.4), counts, seen, 3, torch.zeros(0))
    assert torch.allclose(got, hf)


def test_min_tokens_holds_stops_back_only_until_enough_were_written():
    logits = torch.zeros(5, V)
    cfg = SamplingConfig(min_tokens=6)
    got = process(logits, cfg, torch.zeros(V), torch.zeros(V, dtype=torch.bool), 3,
                  torch.tensor([1, 2, 3, 4]), stops=[0, 11])  # fmt: skip
    # Positions 0..2 write tokens 4, 5, 6 (3, 4, 5 written before): held back; 3, 4 free.
    assert torch.isinf(got[:3, [0, 11]]).all() and not torch.isinf(got[3:]).any()
    assert not torch.isinf(got[:, 1:11]).any()


def test_history_counts_commits_and_builds_lazily():
    cfg = SamplingConfig(frequency_penalty=1.0)
    assert History.of(SamplingConfig(), [1], {0}) is None
    assert History.of(SamplingConfig(min_tokens=2), [1], set()) is None  # nothing to hold back
    h = History.of(cfg, [1, 2], {0})
    assert h is not None
    h.commit([3, 3])
    x = h.apply(torch.zeros(2, V), torch.tensor([3]))
    assert x[0, 3] == -2.0 and x[1, 3] == -3.0 and h.written == 2
    h.commit([4])
    x = h.apply(torch.zeros(1, V), torch.zeros(0, dtype=torch.long))
    assert x[0, 3] == -2.0 and x[0, 4] == -1.0 and x[0, 1] == 0.0


def test_top_k_and_min_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[4 / 7, 3 / 7, 0, 0, 0]]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, min_p=0.2))  # floor 0.08
    assert torch.allclose(p, torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0, 0]]))
    # vLLM's order: min_p, then top_k, then top_p on what is left.
    p = probabilities(logits, SamplingConfig(temperature=1.0, min_p=0.2, top_k=3, top_p=0.5))
    assert torch.allclose(p, torch.tensor([[4 / 7, 3 / 7, 0, 0, 0]]))


def test_logprobs_of_the_processed_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    cfg = SamplingConfig(temperature=1.0, top_k=2)
    logp = log_distribution(logits, cfg)
    (lp,) = token_logprobs(logp, [1], top=3)
    assert lp.token == 1 and lp.logprob == pytest.approx(float(torch.log(torch.tensor(0.375))))
    assert [t for t, _ in lp.top[:2]] == [0, 1] and lp.top[2][1] == LOGPROB_FLOOR  # cut: -inf
    (g,) = token_logprobs(log_distribution(logits, SamplingConfig()), [0], top=0)
    assert g.logprob == pytest.approx(float(torch.log(torch.tensor(0.5)))) and g.top == ()


def test_accept_reads_the_penalised_logits_and_reports_their_logprobs():
    # The raw argmax repeats token 2; the frequency penalty makes the target pick 1 instead.
    logits = torch.tensor([[0.0, 2.0, 2.5, 0.0], [0.0, 2.0, 2.5, 0.0]])
    cfg = SamplingConfig(frequency_penalty=1.0)
    h = History(cfg, [0], set())
    h.commit([2])
    acc = accept(logits, torch.tensor([1]), None, cfg, history=h, logprobs=1)
    assert acc.tokens == [1, 2] and acc.num_accepted == 1
    x = torch.tensor([0.0, 1.0, 1.5, 0.0])  # position 1 has seen 2 once and the draft 1 once
    assert acc.logprobs[1].logprob == pytest.approx(float(torch.log_softmax(x, 0)[2]))
    assert acc.logprobs[1].top[0][0] == 2


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": (-4,)}, "stop_token_ids"),
    ],
)
def test_new_sampling_fields_are_validated(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        SamplingConfig(**kw)


def test_stops_follow_ignore_eos_and_stop_token_ids():
    assert SamplingConfig().stops({7}) == {7}
    assert SamplingConfig(ignore_eos=True, stop_token_ids=(3,)).stops({7}) == {3}
    assert SamplingConfig(stop_token_ids=(3,)).stops({7}) == {3, 7}
