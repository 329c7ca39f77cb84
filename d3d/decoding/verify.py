"""Pure acceptance rules of speculative decoding.

One verification round checks a draft ``d_1..d_K`` against the target's distributions
``p_1..p_{K+1}`` computed in one forward over ``[anchor, d_1..d_K]`` (``p_i`` predicts the
token at draft slot i; ``p_{K+1}`` the token after a fully accepted draft). A round always emits
at least one token, and the last emitted token always comes from the target (a correction on a
miss, the bonus when every draft token passes), which is what makes the output lossless.

- Greedy: accept the longest prefix where ``d_i == argmax p_i``, then emit ``argmax p_{n+1}``.
- Sampling: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
  rejection emit a sample of ``norm(max(0, p_i - q_i))``; if all pass, emit a sample of
  ``p_{K+1}``. With ``d_i ~ q_i`` drawn independently (single-pass drafts) this reproduces the
  target's distribution exactly. A deterministic draft (a copy of the request's own text) has a
  one-hot q.

The target's logits are processed first when the row's history shapes them (penalties,
``min_tokens``: :class:`d3d.decoding.processors.History`), each position with its own history,
drafts included; greedy and sampled acceptance both read the processed logits, and the emitted
tokens' log-probabilities, when asked for, are read from the same distributions.

:func:`accept` is the one place a round's logits become committed tokens, for every mode and
every row of a batch.

Letters: K draft length, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from d3d.config import SamplingConfig
from d3d.decoding.processors import History
from d3d.sampling import TokenLogprob, log_distribution, probabilities, token_logprobs


@dataclass(frozen=True)
class Acceptance:
    """Outcome of one verification round.

    ``tokens`` holds the accepted draft tokens followed by the target's own token, so
    ``len(tokens) == num_accepted + 1``; ``logprobs`` (when asked for) one per token.
    """

    num_accepted: int
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None

    @property
    def num_emitted(self) -> int:
        return len(self.tokens)


def greedy_accept(draft: torch.Tensor, target_argmax: torch.Tensor) -> Acceptance:
    """Longest matching prefix plus the target's token.

    draft: [K] token ids; target_argmax: [K+1] argmax of p_1..p_{K+1}.
    """
    k = draft.shape[0]
    if target_argmax.shape[0] != k + 1:
        raise ValueError(
            f"target_argmax must have K+1={k + 1} entries, got {target_argmax.shape[0]}"
        )
    return greedy_accept_ids(draft.tolist(), target_argmax.tolist())


def greedy_accept_ids(draft: Sequence[int], target_argmax: Sequence[int]) -> Acceptance:
    """:func:`greedy_accept` over plain lists (K and K+1 ids): no tensor op at all."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return Acceptance(num_accepted=n, tokens=[*draft[:n], target_argmax[n]])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` over the vocabulary: [V] -> [V].

    When p == q (the residual is all zero) the rejection had probability 0; fall back to p so
    the function is total.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    if total <= 0:
        return p
    return r / total


def stochastic_accept(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Exact speculative sampling for one round.

    draft: [K] ids sampled from q; q: [K, V] drafter probabilities; p: [K+1, V] target
    probabilities (processed: penalties, temperature, truncation). All on one device.
    """
    k = draft.shape[0]
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(
            f"need q [K, V] and p [K+1, V] with K={k}, got {tuple(q.shape)}, {tuple(p.shape)}"
        )
    idx = torch.arange(k, device=draft.device)
    p_d = p[idx, draft]
    q_d = q[idx, draft]
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    # Accept d_i when u_i * q_i(d_i) < p_i(d_i), i.e. with probability min(1, p/q); the strict
    # inequality never accepts a token the target gives probability 0 (cut by top-p).
    ok = (u * q_d < p_d).to(torch.int64)
    n = int(ok.cumprod(0).sum().item())
    dist = p[k] if n == k else residual_distribution(p[n], q[n])
    last = int(torch.multinomial(dist, 1, generator=generator).item())
    return Acceptance(num_accepted=n, tokens=[int(t) for t in draft[:n].tolist()] + [last])


def one_hot_q(draft: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The distribution a deterministic draft [K] was 'sampled' from: [K, V] one-hot rows."""
    q = torch.zeros(draft.shape[0], vocab_size, device=draft.device)
    q[torch.arange(draft.shape[0], device=draft.device), draft] = 1.0
    return q


def accept(
    logits: torch.Tensor,
    draft: torch.Tensor,
    q: torch.Tensor | None,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    history: History | None = None,
    logprobs: int | None = None,
    argmax: Sequence[int] | None = None,
) -> Acceptance:
    """One round of one row: the target's logits [K+1, V] over ``[anchor, d_1..d_K]``, the
    draft [K] and its q [K, V] (None: a deterministic draft, one-hot; ignored when greedy).
    K = 0 is a plain step: the target's own token. ``history``: the row's, when penalties or
    ``min_tokens`` apply; ``logprobs``: report each emitted token's log-probability and that
    many alternatives (None: none). ``argmax``: the logits' argmax per position where the caller
    took it for many rows at once (used only when greedy, without history or logprobs: then
    the logits are the processed ones)."""
    if argmax is not None and sampling.greedy and history is None and logprobs is None:
        return greedy_accept_ids(draft.tolist(), argmax)
    d = draft.to(logits.device)
    x = history.apply(logits, d) if history is not None else logits
    if sampling.greedy:
        acc = greedy_accept(d, x.argmax(dim=-1))
    else:
        p = probabilities(x, sampling)
        q = one_hot_q(d, p.shape[-1]) if q is None else q.to(p.device, p.dtype)
        acc = stochastic_accept(d, q, p, generator)
    if logprobs is None:
        return acc
    logp = log_distribution(x[: acc.num_emitted], sampling)
    return Acceptance(acc.num_accepted, acc.tokens, token_logprobs(logp, acc.tokens, logprobs))
