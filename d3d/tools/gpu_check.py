"""GPU readiness check: the forwards that decide whether asynchronous drafting pays, and the
engine serving concurrent requests, timed on a GPU.

``scripts/gpu_check.sh`` (``python -m d3d.tools.gpu_check --out gpu_check.json``) builds a
random-weight target shaped by ``d3d/configs/qwen3-8b.json`` in bf16 directly on the GPU (no
download, no tokenizer: token ids suffice), then runs three stages, each writing the JSON as it ends
(so a run cut short keeps what it finished):

1. **check** — after a cached context: a target decode step (1 token) and a 16-token verify
   forward; drafters made of the target's first 5 and 31 layers: a block forward and the
   branch-drafting forward with 1..8 branches (the chain of the draft being verified plus one
   block per branch, one 4D mask: :mod:`d3d.worker.drafting`); the overlap of drafter and target
   on one GPU: the verify forward and an 8-branch forward one after the other, then at the same
   time on two CUDA streams from two threads; overlap factor = sequential / concurrent time
   (2.0 = fully hidden, 1.0 = none); memory (CUDA's allocator; None on a CPU) beside what
   :mod:`d3d.model.memory` counts, as ``d3d plan`` does. Medians over repeats.
2. **service** — the library's engine over the same target with a ``self:5`` drafter, 16
   concurrent requests per mode (``ar``, ``sync``, ``async``) through ``Scheduler.step()``:
   throughput, steps, verify times, acceptance, and the peak memory per device beside
   ``d3d plan``'s prediction (:mod:`d3d.tools.gpu_service`).
3. **vllm** — the same target served by vLLM alone and by vLLM with the D3D proposer (its drafter
   on the second GPU when there is one), 16 concurrent greedy requests per mode: throughput,
   identity with vLLM alone, acceptance, branch hits, memory (:mod:`d3d.tools.gpu_vllm`; skipped
   where vLLM is not installed).

Every stage has a time limit inside ``--budget-s`` (the script's 8 minutes, less a margin).
``--tiny`` runs the same code on a small Qwen3-shaped model (on CPU if there is no GPU), which is
how the tests keep this script working; the full shape refuses to run without CUDA. How to read
the JSON: ``docs/results.md`` (GPU check).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from d3d.backends.hf import trim_cache, with_cache
from d3d.backends.sizes import kv_bytes_per_token
from d3d.model.drafter import D3DDrafter
from d3d.model.memory import param_bytes
from d3d.tools.gpu_service import ServiceSettings, run_service, service_errors, service_table
from d3d.tools.gpu_vllm import run_vllm, vllm_errors
from d3d.tools.plan import CONFIGS
from d3d.worker.drafting import draft_branches

log = logging.getLogger(__name__)

SHAPE = "qwen3-8b"  # d3d/configs/qwen3-8b.json
TINY = dict(  # the same architecture, small enough for a CPU test
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    max_window_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # the smallest head vLLM's CPU attention takes (the vLLM stage)
    max_position_embeddings=4096,
    bos_token_id=0,
)
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)


class CheckError(RuntimeError):
    """The check cannot run here; the message says why in one line."""


def target_config(tiny: bool) -> tuple[str, dict]:
    """The shipped Qwen3-8B config as a dict (``tiny``: with small dimensions), with EOS off so
    every request of the service run goes to its budget; and its name for the JSON."""
    d = json.loads((CONFIGS / f"{SHAPE}.json").read_text())
    if tiny:
        d.update(TINY)
    d.pop("layer_types", None)  # rebuilt from num_hidden_layers
    d["eos_token_id"] = None
    return (f"{SHAPE}-tiny" if tiny else SHAPE), d


def build_target(config: dict, device: torch.device, dtype: torch.dtype):
    """Random weights, made directly on ``device`` in ``dtype``."""
    d = dict(config)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


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
def run_check(
    target,
    weight_bytes: int | None,
    context: int,
    repeats: int,
    drafter_layers: list[int],
    time_left,
) -> dict:
    """Stage 1 (module docstring). ``weight_bytes``: what building the target allocated;
    ``time_left()``: seconds left (drafters that do not fit are skipped)."""
    cfg = target.config
    device, dtype = target.device, target.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)
    a1 = _allocated(device)
    cache = DynamicCache()
    target(input_ids=ids, **with_cache(target, cache))
    memory = {
        "target_weight_bytes": {"allocated": weight_bytes, "counted": param_bytes(target)},
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
        "target_step_ms": _median_ms(lambda: target_forward(1), device, repeats),
        "target_verify16_ms": _median_ms(lambda: target_forward(16), device, repeats),
        "memory": memory,
        "drafters": {},
    }
    for n_layers in drafter_layers:
        n_layers = min(n_layers, cfg.num_hidden_layers)
        if time_left() < 30:
            out["drafters"][n_layers] = {"skipped": "out of time"}
            continue
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


def _device(tiny: bool, asked: str | None) -> torch.device:
    """The check's device: ``asked``, else CUDA where there is one; the full shape needs CUDA."""
    if (asked and asked.startswith("cuda")) or (not asked and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise CheckError(f"device {asked!r} asked for, but torch sees no CUDA device")
        dev = torch.device(asked or "cuda")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise CheckError(f"device {asked!r}: only {torch.cuda.device_count()} GPU(s)")
        return torch.device("cuda", index)
    if not tiny:
        raise CheckError(
            "no CUDA device: the Qwen3-8B shape runs on a GPU only (torch.cuda.is_available() "
            "is False; is a CUDA build of torch installed?). --tiny runs the small model on CPU"
        )
    return torch.device("cpu")


def _table(res: dict) -> str:
    """A short summary of the JSON for the terminal."""
    lines = [
        f"{res.get('device')} {res.get('dtype')}: target step {res.get('target_step_ms')} ms, "
        f"verify16 {res.get('target_verify16_ms')} ms"
    ]
    for n, row in res.get("drafters", {}).items():
        ov = row.get("overlap", {}).get("overlap_factor")
        lines.append(f"drafter {n} layers: block {row.get('block_ms')} ms, overlap {ov}")
    lines += service_table(res.get("service") or {})
    if res.get("errors"):
        lines.append("errors: " + "; ".join(res["errors"]))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m d3d.tools.gpu_check", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--tiny", action="store_true", help="a small model (CPU works), for tests")
    p.add_argument("--device", default=None, help="cuda, cuda:N (default), or cpu with --tiny")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="the target's dtype (default bf16 on CUDA, fp32 on CPU; float32: greedy exactness "
        "across batch shapes, which bf16 rounding does not promise)",
    )
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--drafter-layers", default="5,31")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time limit")
    g = p.add_argument_group("service run (d3d.tools.gpu_service)")
    g.add_argument("--service", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--requests", type=int, default=16, help="concurrent requests")
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--modes", default="ar,sync,async")
    g.add_argument("--drafter", default="self:5", help="the engine's drafter spec")
    g.add_argument("--drafter-device", default=None, help="default: the target's device")
    g.add_argument("--stage-seconds", type=float, default=90.0, help="each mode's time limit")
    v = p.add_argument_group("vLLM run (d3d.tools.gpu_vllm)")
    v.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, run the stages (each writes the JSON as it ends), print a summary; 0 when every
    stage ran, 1 when one failed (its error is in the JSON), 2 for bad flags or no GPU."""
    p = _parser()
    args = p.parse_args(argv)
    t_start = time.perf_counter()

    def time_left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    try:
        layers = [int(x) for x in args.drafter_layers.split(",") if x.strip()]
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        service = ServiceSettings(
            args.requests, args.prompt_tokens, args.new_tokens, modes, args.drafter,
            args.drafter_device, args.stage_seconds,
        )  # fmt: skip
    except ValueError as exc:  # a ServiceError names the flag's field
        p.error(str(exc))
    try:
        device = _device(args.tiny, args.device)
    except CheckError as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    name, config = target_config(args.tiny)
    res: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_device": str(device),
        "dtype": str(dtype),
        "target": name,
        "target_shape": {k: config[k] for k in SHAPE_KEYS},
        "context": args.context,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
        "errors": [],
        "stages": {},
    }
    out = Path(args.out)

    def stage(what: str, fn) -> None:
        """Run one stage; its figures go into ``res`` and the JSON is written as it ends."""
        t0 = time.perf_counter()
        try:
            res.update(fn())
        except Exception as exc:  # recorded; the JSON still holds every other stage
            log.exception("gpu check stage %s failed", what)
            res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
        res["stages"][what] = round(time.perf_counter() - t0, 2)
        res["elapsed_s"] = round(time.perf_counter() - t_start, 2)
        out.write_text(json.dumps(res, indent=2))

    target = None
    a0 = _allocated(device)

    def build() -> dict:
        nonlocal target
        target = build_target(config, device, dtype)
        return {"build_s": round(time.perf_counter() - t_start, 2)}

    def check() -> dict:
        weights = _delta(_allocated(device), a0)
        return run_check(target, weights, args.context, args.repeats, layers, time_left)

    def serve() -> dict:
        svc = run_service(target, name, config, service, time_left)
        res["errors"] += [f"service {e}" for e in service_errors(svc)]
        return {"service": svc}

    stage("build", build)
    if target is not None:
        stage("check", check)
        gc.collect()  # the check's caches and drafters go before the service's peak is taken
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.service:
            stage("service", serve)

        def vllm() -> dict:
            got = run_vllm(
                target, args.requests, args.prompt_tokens, args.new_tokens, args.drafter, time_left
            )  # fmt: skip
            res["errors"] += [f"vllm {e}" for e in vllm_errors(got)]
            return {"vllm": got}

        if args.vllm and time_left() > 60:
            stage("vllm", vllm)
    print(_table(res))
    print(f"wrote {out}", file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
