"""A job as vLLM's request, and vLLM's output back as the service's: the sampling parameters
(the same fields with the same meanings, the mode for the D3D proposer) and the per-token
log-probabilities."""

from __future__ import annotations

from d3d.config import SamplingConfig
from d3d.sampling import TokenLogprob

STOP_REASONS = {"stop": "eos", "length": "length", "abort": "cancelled"}


def sampling_params(
    sampling: SamplingConfig,
    max_tokens: int,
    eos: set[int],
    mode: str,
    n: int = 1,
    logprobs: int | None = None,
):
    """vLLM's sampling parameters for a job: the same fields with the same meanings (vLLM's),
    token deltas, no detokenizing (the service decodes text itself), the target's end ids as
    stop ids unless ``ignore_eos``, the mode for the proposer."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = sampling
    stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos))
    return SamplingParams(
        n=n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens,
        ignore_eos=s.ignore_eos,
        seed=s.seed,
        max_tokens=max_tokens,
        stop_token_ids=sorted(stops),
        logprobs=logprobs,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"d3d_mode": mode},
    )


def token_logprobs(out, ids: list[int]) -> list[TokenLogprob]:
    """vLLM's per-token logprob dicts as the service's :class:`TokenLogprob` (the emitted
    token's log-probability and the most likely ones, best first)."""
    result = []
    for tok, entry in zip(ids, out.logprobs or [], strict=False):
        top = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])
        own = entry.get(tok)
        result.append(
            TokenLogprob(tok, own.logprob if own is not None else float("-inf"), tuple(top))
        )
    return result
