"""The rows of ``d3d eval speed``: one request decoded by one method, timed the same way.

Every row reports the tokens generated after the prefill and the seconds they took, so
tokens/s and time per output token mean the same thing for all of them (the prefill's own
token is not counted). CPU budgets are part of a row's definition and set before it runs:

- ``one``: one core, one thread (decoding a 135M model is memory-bound here, and one thread
  is no slower); ``ar``, the HF rows and ``sync`` (drafter and target taking turns) use it;
- ``all``: every core the process may use, one torch thread per core (the hardware budget of
  ``async``: the row that tells whether the second core is better spent on the drafter);
- ``pinned``: the engine's placement: the target on its cores, the drafter process on its own.

Hugging Face ``generate`` rows run the same target model; a streamer stamps the first new token
so their prefill is left out too. Prompt-lookup decoding is HF's n-gram drafting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from d3d.config import DecodeConfig, ModelConfig
from d3d.engine import Engine
from d3d.engine.placement import resolve_placement
from d3d.worker import pin_process
from d3d.worker.workers import available_cores


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    mode: str | None  # an engine mode, or None for a Hugging Face generate row
    cpu: str  # "one", "all" or "pinned"
    hf: dict = field(default_factory=dict)


METHODS = {
    m.key: m
    for m in (
        Method("ar-1t", "ar (1 thread)", "ar", "one"),
        Method("ar-all", "ar (all cores)", "ar", "all"),
        Method("hf", "HF generate (greedy)", None, "one"),
        Method("hf-lookup", "HF prompt lookup", None, "one", {"prompt_lookup_num_tokens": 10}),
        Method("sync", "sync", "sync", "one"),
        Method("async", "async", "async", "pinned"),
        Method("auto", "auto", "auto", "pinned"),
    )
}
AR_KEYS = ("ar-1t", "ar-all")


# Every core this process may use, read before any row narrows its affinity.
ALL_CORES = available_cores()


def set_cpu(engine: Engine, budget: str) -> None:
    """Give this process the CPU budget a row is defined with (``pinned`` rows leave it to the
    engine, which widens the target to every core whenever ``auto`` takes plain steps)."""
    engine.manage_cpu = budget == "pinned"
    if budget == "one":
        pin_process(ALL_CORES[:1], 1)
    elif budget == "all":
        pin_process(ALL_CORES, len(ALL_CORES))
    else:
        cfg = engine.model_cfg or ModelConfig()
        place = resolve_placement(cfg.target_device, cfg.drafter_device, ALL_CORES)
        target = list(place.target_cores) or ALL_CORES
        pin_process(target, len(target))


class _FirstToken(BaseStreamer):
    """Stamps the time of the first generated token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.t_first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(engine: Engine, prompt_ids: list[int], max_new: int, extra: dict) -> dict:
    model = engine.target.model
    eos = sorted(engine.target.eos_token_ids)
    x = torch.tensor([prompt_ids], device=engine.target.device)
    streamer = _FirstToken()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=eos[0],
            streamer=streamer,
            **extra,
        )
    t_end = time.perf_counter()
    ids = [int(t) for t in out[0, len(prompt_ids) :].tolist()]
    t_first = streamer.t_first or t_end
    return {
        "token_ids": ids,
        "num_tokens": len(ids),
        "prefill_s": t_first - t0,
        "decode_s": t_end - t_first,
    }


def run_method(engine: Engine, method: Method, prompt_ids: list[int], max_new: int) -> dict:
    """Decode one request with one method; a flat record of what it did."""
    set_cpu(engine, method.cpu)
    if method.mode is None:
        rec = run_hf(engine, prompt_ids, max_new, method.hf)
    else:
        gen = engine.generate_ids(
            prompt_ids, DecodeConfig(mode=method.mode, max_new_tokens=max_new)
        )
        s = gen.stats
        rec = {
            "token_ids": gen.token_ids,
            "num_tokens": s.num_tokens,
            "prefill_s": s.prefill_seconds,
            "decode_s": s.decode_seconds,
            "num_drafts": s.num_drafts,
            "num_accepted_tokens": s.num_accepted_tokens,
            "draft_s": s.draft_seconds,
            "verify_s": s.verify_seconds,
            "branch_hits": s.branch_hits,
            "branch_misses": s.branch_misses,
            "branches_prepared": s.branches_prepared,
            "branch_rounds": s.branch_rounds,
            "hit_round_s": s.hit_round_seconds,
            "hit_verify_s": s.hit_verify_seconds,
            "spec_tokens": s.spec_tokens,
            "ar_tokens": s.ar_tokens,
            "worker_failures": s.worker_failures,
        }
    rec["method"] = method.key
    rec["threads"] = torch.get_num_threads()
    return rec
