"""GPU readiness check: the forwards that decide whether asynchronous drafting pays, timed on a GPU.

``python -m d3d.tools.gpu_check --out gpu_check.json`` (or ``scripts/gpu_check.sh``) builds a
random-weight target shaped like Qwen3-8B in bf16 directly on the GPU (no download), drafters
made of its first 5 and first 31 layers, and times, after a cached context:

- a target decode step (1 token) and a 16-token verify forward;
- each drafter's block forward and its branch-drafting forward with 1..8 branches (the chain of
  the draft being verified plus one block per branch, one 4D mask: :mod:`d3d.worker.drafting`);
- the overlap of drafter and target on one GPU: the verify forward and an 8-branch forward run
  one after the other, then at the same time on two CUDA streams from two threads; the overlap
  factor is (sequential time) / (concurrent time) (2.0 = fully hidden, 1.0 = none);
- memory (CUDA's allocator; None on a CPU) beside what :mod:`d3d.model.memory` counts, as ``d3d plan``
  does: the target's weights, the KV of the context, and what building each drafter beside the
  target allocates (it shares the target's tensors: about its mask embedding) and at its peak.

All figures are medians over repeats, written as one JSON. ``--tiny`` runs the same code on a
small model (on CPU if there is no GPU), which is how the tests keep this script working.
It is meant to finish in under 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

from d3d.model.drafter import D3DDrafter
from d3d.model.hf import trim_cache, with_cache
from d3d.model.memory import kv_bytes_per_token, param_bytes
from d3d.worker.drafting import draft_branches

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


@torch.inference_mode()
def run_check(tiny: bool, context: int, repeats: int, drafter_layers: list[int]) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if tiny else QWEN3_8B
    cfg = Qwen3Config(**shape)
    t0 = time.perf_counter()
    a0 = _allocated(device)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    target.eval().requires_grad_(False)
    build_s = time.perf_counter() - t0
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)
    a1 = _allocated(device)
    cache = DynamicCache()
    target(input_ids=ids, **with_cache(target, cache))
    memory = {
        "target_weight_bytes": {"allocated": _delta(a1, a0), "counted": param_bytes(target)},
        "kv_bytes": {
            "allocated": _delta(_allocated(device), a1),
            "counted": kv_bytes_per_token(cfg, dtype) * context,
        },
    }

    def target_forward(n: int) -> None:
        x = ids[:, :n]
        pos = torch.arange(context, context + n, device=device).unsqueeze(0)
        target(input_ids=x, position_ids=pos, **with_cache(target, cache))
        trim_cache(cache, n)

    out: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "target_shape": shape,
        "context": context,
        "repeats": repeats,
        "build_s": round(build_s, 2),
        "target_step_ms": _median_ms(lambda: target_forward(1), device, repeats),
        "target_verify16_ms": _median_ms(lambda: target_forward(16), device, repeats),
        "memory": memory,
        "drafters": {},
    }
    for n_layers in drafter_layers:
        n_layers = min(n_layers, cfg.num_hidden_layers)
        out["drafters"][n_layers] = _drafter_row(
            target, n_layers, ids, device, repeats, lambda: target_forward(16)
        )
    return out


def _drafter_row(target, n_layers: int, ids: torch.Tensor, device, repeats: int, verify) -> dict:
    before = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    drafter = D3DDrafter.from_target(target, n_layers, device=device, share=True)
    memory = {
        "drafter_bytes": _delta(_allocated(device), before),
        "build_peak_extra_bytes": _delta(
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None, before
        ),
    }
    d_cache = DynamicCache()
    drafter.encode(ids[0].tolist(), d_cache)
    anchor = int(ids[0, -1])
    chain = ids[0, :16].tolist()

    def branches(n: int) -> None:
        s = d_cache.get_seq_length()
        draft_branches(drafter, d_cache, [s + k for k in range(n)], chain[:n], chain=chain)
        trim_cache(d_cache, len(chain))

    return {
        "block_ms": _median_ms(lambda: drafter.block_scores(anchor, d_cache), device, repeats),
        "branches_ms": {
            n: _median_ms(lambda n=n: branches(n), device, repeats) for n in range(1, 9)
        },
        "overlap": _overlap(verify, lambda: branches(8), device, repeats),
        "memory": memory,
    }


def _overlap(verify, branch, device: torch.device, repeats: int) -> dict:
    """Sequential vs concurrent (two streams, two threads) time of verify and branch forwards."""
    streams = (
        (torch.cuda.Stream(device), torch.cuda.Stream(device))
        if device.type == "cuda"
        else (None, None)
    )

    def on(stream, fn):
        def run():
            with torch.inference_mode():
                if stream is None:
                    fn()
                else:
                    with torch.cuda.stream(stream):
                        fn()

        return run

    def concurrent() -> None:
        threads = [
            threading.Thread(target=on(s, f))
            for s, f in zip(streams, (verify, branch), strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    seq = _median_ms(lambda: (verify(), branch()), device, repeats)
    par = _median_ms(concurrent, device, repeats)
    return {"sequential_ms": seq, "concurrent_ms": par, "overlap_factor": round(seq / par, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m d3d.tools.gpu_check", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--tiny", action="store_true", help="a small model (CPU works), for tests")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--drafter-layers", default="5,31")
    args = p.parse_args(argv)
    layers = [int(x) for x in args.drafter_layers.split(",")]
    result = run_check(args.tiny, args.context, args.repeats, layers)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
