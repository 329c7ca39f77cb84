"""Acceptance rules on hand-made cases."""

import pytest
import torch

from d3d.decoding.verify import greedy_accept, residual_distribution, stochastic_accept


def t(*xs):
    return torch.tensor(xs)


@pytest.mark.parametrize(
    ("draft", "target", "n", "tokens"),
    [
        ((5, 6, 7), (5, 6, 7, 8), 3, [5, 6, 7, 8]),  # all accepted + bonus
        ((5, 6, 7), (1, 6, 7, 8), 0, [1]),  # first miss: only the correction
        ((5, 6, 7), (5, 9, 7, 8), 1, [5, 9]),  # a later match after a miss does not count
        ((5, 6, 7), (5, 6, 2, 8), 2, [5, 6, 2]),
    ],
)
def test_greedy_accept(draft, target, n, tokens):
    acc = greedy_accept(t(*draft), t(*target))
    assert acc.num_accepted == n
    assert acc.tokens == tokens
    assert acc.num_emitted == n + 1


def test_greedy_accept_checks_shapes():
    with pytest.raises(ValueError, match="K\\+1"):
        greedy_accept(t(1, 2), t(1, 2))


def onehot(i, v=4):
    x = torch.zeros(v)
    x[i] = 1.0
    return x


def test_stochastic_accepts_everything_when_p_equals_q():
    q = torch.softmax(torch.randn(3, 4), -1)
    p = torch.cat([q, onehot(2).unsqueeze(0)])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        d = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        acc = stochastic_accept(d, q, p, gen)
        assert acc.num_accepted == 3
        assert acc.tokens == [*d.tolist(), 2]  # the bonus comes from p_{K+1}


def test_stochastic_rejects_tokens_the_target_never_emits():
    q = torch.stack([onehot(1), onehot(1)])
    p = torch.stack([onehot(3), onehot(0), onehot(0)])
    acc = stochastic_accept(t(1, 1), q, p, torch.Generator().manual_seed(0))
    assert acc.num_accepted == 0
    assert acc.tokens == [3]  # residual of p - q is all on token 3


def test_residual_distribution():
    p = t(0.5, 0.3, 0.2, 0.0)
    q = t(0.2, 0.6, 0.2, 0.0)
    r = residual_distribution(p.float(), q.float())
    assert torch.allclose(r, t(1.0, 0.0, 0.0, 0.0).float())
    # p == q has no residual mass: falls back to p rather than dividing by zero
    assert torch.equal(residual_distribution(p.float(), p.float()), p.float())


def test_first_emitted_token_follows_p_exactly():
    """Marginal of the first emitted token over many rounds equals p_1, whatever q is."""
    gen = torch.Generator().manual_seed(1)
    p1 = t(0.1, 0.6, 0.05, 0.25).float()
    q1 = t(0.7, 0.1, 0.1, 0.1).float()  # strongly different from p
    p = torch.stack([p1, onehot(0), onehot(0)])
    q = torch.stack([q1, onehot(2)])
    n = 20000
    counts = torch.zeros(4)
    for _ in range(n):
        d = torch.stack([torch.multinomial(q1, 1, generator=gen)[0], torch.tensor(2)])
        acc = stochastic_accept(d, q, p, gen)
        counts[acc.tokens[0]] += 1
    freq = counts / n
    assert torch.allclose(freq, p1, atol=0.015), freq


def test_stochastic_checks_shapes():
    with pytest.raises(ValueError):
        stochastic_accept(t(1, 2), torch.rand(2, 4), torch.rand(2, 4))
