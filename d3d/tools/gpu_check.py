"""GPU check: what the paper and the field measure, on one GPU, in one run, one JSON.

``scripts/gpu_check.sh`` (``python -m d3d.tools.gpu_check --out gpu_check.json``) builds a
random-weight target shaped by ``d3d/configs/qwen3-8b.json`` in bf16 directly on the GPU (no
download, no tokenizer: token ids suffice) and runs these stages, each writing the JSON as it
ends (a run cut short keeps what it finished):

1. **bandwidth** — the device's copy rate, the yardstick of every floor.
2. **decode** — the target's step through the backend the engine runs it with (on a GPU the
   cuda backend: fixed-slot KV, decode steps replayed from CUDA graphs) at 1 / 16 / 64 rows
   after a cached context: a plain step and a 16-token verify step, each against its
   bandwidth floor; 16 rows against one; the verify against a plain step.
3. **drafters** — the drafter's block and a packed round of 8 branches, for the D3D-1.7B shape
   (Qwen3-1.7B's dimensions, ``d3d/configs/qwen3-1.7b.json``) and for the target's first 31
   layers (the paper's pruned 8B drafter), against the target's verify.
4. **exactness** — greedy decoding through captured steps against the same steps eager, in
   float32, token for token (a few layers of the target's shape); and with two targets capturing
   and decoding in two threads at once, as the engine's target and a drafter thread do.
5. **replay** — the engine serving requests in ``ar``, ``sync`` and ``async`` with the replay
   drafter at the paper's acceptance (``replay:7.88``: a measurement instrument, the target's
   own recorded tokens corrupted to that mean acceptance, :mod:`d3d.replay`), at 1 and 16
   rows on this one GPU (:mod:`d3d.tools.gpu_service`: each mode run once unmeasured first,
   so no graph is captured in the measured time); and the two-GPU figure projected from
   the measured primitives: with the drafter on its own GPU a round is hidden when it fits
   inside a verify, so a round costs max(verify, packed round) plus the drafter's block on a
   branch miss (:func:`projection`), beside the paper's 5.00x. Then (``shaped_replay_N``) the
   same at 1 row with a drafter of the D3D-1.7B shape running its real forwards beside the
   replay (``replay:7.88:0.78:shape=qwen3-1.7b``; on the cuda backend the worker's packed,
   captured forwards, ``sync`` drafting there too), so drafting costs what the worker's costs.
6. **memory** — the peak allocation against ``d3d plan``'s count (run right after decode).
   **profile** — the 1-row step's kernels by kind, eager and replayed, against its wall time
   (:mod:`d3d.tools.step_profile`): where the time beyond the floor goes (run after the other
   stages of the target: a profiler that fails hard on graph replays loses only itself).
7. **vllm** — vLLM alone and with the D3D proposer on the same target, where vLLM is installed
   (:mod:`d3d.tools.gpu_vllm`; skipped otherwise, as on the lent check machines).

Every stage has a time limit inside ``--budget-s``. ``--tiny`` runs the same code on a small
Qwen3-shaped model on the CPU (the cuda backend's step code eager there; the exactness stage
rehearses its graphs, :mod:`d3d.backends.cuda.rehearsal`), which is how CI keeps this script
working; the full shape refuses to run without CUDA. The figures and how to read them:
``docs/results.md`` (GPU check); the table printed at the end is
:func:`d3d.tools.gpu_report.table`'s.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from d3d.backends.cuda import CudaBackend
from d3d.model.drafter import D3DDrafter
from d3d.model.shapes import CONFIGS
from d3d.tools import gpu_stages as st
from d3d.tools.gpu_report import table
from d3d.tools.gpu_service import ServiceSettings, run_service, service_errors
from d3d.tools.gpu_vllm import run_vllm, vllm_errors
from d3d.tools.step_profile import step_profile

log = logging.getLogger(__name__)

SHAPE, DRAFTER_SHAPE = "qwen3-8b", "qwen3-1.7b"  # d3d/configs/
PAPER = {"acceptance": 7.88, "hit_rate": 0.78, "speedup_two_gpus": 5.00}
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
TINY_DRAFTER = dict(TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
SHAPE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
)  # fmt: skip


class CheckError(RuntimeError):
    """The check cannot run here; the message says why in one line."""


def shape_config(shape: str, tiny: dict | None) -> dict:
    """A shipped config as a dict (``tiny``: with these small dimensions instead), EOS off so
    every request of a serving stage runs to its budget."""
    d = json.loads((CONFIGS / f"{shape}.json").read_text())
    if tiny:
        d.update(tiny)
    d.pop("layer_types", None)  # rebuilt from num_hidden_layers
    d["eos_token_id"] = None
    return d


def projection(step_ms: float, verify_ms: float, round_ms: float, block_ms: float,
               acceptance: float, hit: float) -> dict:  # fmt: skip
    """The two-GPU speed-up over ``ar`` from measured primitives: a round emits ``acceptance``
    tokens and costs max(verify, packed round) (the drafter on its own GPU prepares the next
    round's branches while the target verifies) plus, on a branch miss (1 - ``hit``), the
    drafter's block drafted while the target waits; ``ar`` emits one token a plain step."""
    cost = max(verify_ms, round_ms) + (1 - hit) * block_ms
    return {
        "round_ms": round(cost, 4),
        "hidden": round_ms <= verify_ms,
        "speedup_vs_ar": round(acceptance * step_ms / cost, 3),
        "paper_speedup": PAPER["speedup_two_gpus"],
    }


def _device(tiny: bool, asked: str | None) -> torch.device:
    """The check's device: ``asked``, else CUDA where there is one; the full shape needs CUDA."""
    if (asked and asked.startswith("cuda")) or (not asked and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise CheckError(f"device {asked!r} asked for, but torch sees no CUDA device")
        dev = torch.device(asked or "cuda")
        return torch.device("cuda", dev.index if dev.index is not None else 0)
    if not tiny:
        raise CheckError(
            "no CUDA device: the Qwen3-8B shape runs on a GPU only (torch.cuda.is_available() "
            "is False; is a CUDA build of torch installed?). --tiny runs the small model on CPU"
        )
    return torch.device("cpu")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m d3d.tools.gpu_check", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--tiny", action="store_true", help="a small model (CPU works), for tests")
    p.add_argument("--device", default=None, help="cuda, cuda:N (default), or cpu with --tiny")
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the target's and drafters' (auto: bfloat16 on a GPU, float32 on a CPU)",
    )
    p.add_argument("--context", type=int, default=1024, help="cached tokens before each step")
    p.add_argument("--rows", default="1,16,64", help="decode stage: rows per step")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--drafter-layers", type=int, default=31, help="the 8B drafter's depth")
    p.add_argument("--exact-layers", type=int, default=2, help="exactness stage: fp32 layers")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole run's time limit")
    g = p.add_argument_group("replay stage (d3d.tools.gpu_service)")
    g.add_argument("--replay", default=f"replay:{PAPER['acceptance']}:{PAPER['hit_rate']}")
    g.add_argument("--replay-rows", default="1,16")
    g.add_argument(
        "--shaped-rows",
        default="1",
        help=f"rows of the replay with the {DRAFTER_SHAPE} shape's real forwards ('' for none)",
    )
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--modes", default="ar,sync,async")
    g.add_argument("--stage-seconds", type=float, default=60.0, help="each mode's time limit")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True)
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
        rows = [int(x) for x in args.rows.split(",") if x.strip()]
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        services, shaped = (
            [
                ServiceSettings(n, args.prompt_tokens, args.new_tokens, modes, args.replay, None,
                                args.stage_seconds)
                for n in (int(x) for x in flag.split(",") if x.strip())
            ]
            for flag in (args.replay_rows, args.shaped_rows)
        )  # fmt: skip
    except ValueError as exc:  # a ServiceError names the flag's field
        p.error(str(exc))
    try:
        device = _device(args.tiny, args.device)
    except CheckError as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto if args.dtype == "auto" else getattr(torch, args.dtype)
    config = shape_config(SHAPE, TINY if args.tiny else None)
    name = f"{SHAPE}-tiny" if args.tiny else SHAPE
    res: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "target": name,
        "target_shape": {k: config.get(k) for k in SHAPE_KEYS},
        "context": args.context,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
        "paper": PAPER,
        "errors": [],
        "stages": {},
    }
    out = Path(args.out)

    def stage(what: str, fn: Callable[[], dict]) -> None:
        """Run one stage; its figures go into ``res`` and the JSON is written as it ends."""
        t0 = time.perf_counter()
        if time_left() < 10:
            res[what] = {"skipped": "out of time"}
        else:
            try:
                res[what] = fn()
            except Exception as exc:  # recorded; the JSON still holds every other stage
                log.exception("gpu check stage %s failed", what)
                res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
        res["stages"][what] = round(time.perf_counter() - t0, 2)
        res["elapsed_s"] = round(time.perf_counter() - t_start, 2)
        out.write_text(json.dumps(res, indent=2))

    big = device.type == "cuda" and not args.tiny
    target = st.build_model(config, device, dtype)
    res["target_margins"] = st.wide_margins(target)  # the replay's recording holds in bf16
    CudaBackend().prepare(target)  # as Engine.from_config: q, k, v and gate, up laid out
    if device.type == "cuda":  # the memory stage measures serving, not the load's transients
        torch.cuda.reset_peak_memory_stats(device)
    res["build_s"] = round(time.perf_counter() - t_start, 2)
    bandwidth = {}

    def bw() -> dict:
        bandwidth.update(st.copy_bandwidth(device, (1 << 30) if big else (1 << 24), args.repeats))
        return bandwidth

    stage("bandwidth", bw)
    rate = bandwidth.get("bytes_per_s") or 1.0
    graphs = device.type == "cuda"
    stage("decode", lambda: st.decode_steps(target, rows, args.context, args.repeats, rate, graphs))
    # the peak so far is the decode stage's widest step (the replay stages reset the peak)
    kv = args.context + 2 * st.BLOCK
    stage("memory", lambda: st.memory_against_plan(config, device, dtype, max(rows), kv))
    stage("drafters", lambda: _drafters(target, args, device, dtype, res))
    stage("exactness", lambda: _exactness(config, device, args))
    for s in services:
        key = f"replay_{s.requests}"
        stage(key, lambda s=s, key=key: _replay(target, name, config, s, time_left, res, key))
    with tempfile.TemporaryDirectory() as tmp:  # --tiny: the small shape's config
        spec = f"{args.replay}:shape={_drafter_shape(args, target, Path(tmp))}"
        for s in (replace(s, drafter=spec) for s in shaped):
            key = f"shaped_replay_{s.requests}"
            stage(key, lambda s=s, key=key: _replay(target, name, config, s, time_left, res, key))
    stage("projection", lambda: _projection(res))
    # last of the target's stages: a profiler that fails hard on graph replays loses only this
    stage("profile", lambda: step_profile(target, args.context))
    target = None  # the vLLM stage builds its own copy
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.vllm:
        stage("vllm", lambda: _vllm(config, device, dtype, args, time_left, res))
    print(table(res))
    print(f"wrote {out}", file=sys.stderr)
    return 1 if res["errors"] else 0


def _drafters(target, args, device: torch.device, dtype: torch.dtype, res: dict) -> dict:
    verify = ((res.get("decode") or {}).get("rows") or {}).get("1", {}).get("verify16_ms")
    shape = shape_config(DRAFTER_SHAPE, TINY_DRAFTER if args.tiny else None)
    shape["vocab_size"] = target.config.vocab_size
    out = {}
    small = st.d3d_1_7b_drafter(shape, device, dtype)
    out["d3d_1_7b"] = st.drafter_rounds(small, args.context, args.repeats)
    del small
    depth = min(args.drafter_layers, target.config.num_hidden_layers)
    deep = D3DDrafter.from_target(target, depth, device=device, share=True)
    out[f"self_{depth}"] = st.drafter_rounds(deep, args.context, args.repeats)
    del deep
    for row in out.values():
        if verify:
            row["packed_8_over_verify16"] = round(row["packed_8_branches_ms"] / verify, 3)
            row["block_over_verify16"] = round(row["block_ms"] / verify, 3)
    return out


def _exactness(config: dict, device: torch.device, args) -> dict:
    model = st.build_model(config, device, torch.float32, layers=args.exact_layers)
    try:
        return st.captured_equals_eager(model, rows=16, prompt=24, steps=16)
    finally:
        del model


def _drafter_shape(args, target, folder: Path) -> str:
    """The replay's drafter shape: ``qwen3-1.7b`` (a shipped config), or with ``--tiny`` the
    small drafter's dimensions, written into ``folder`` as a config of its own."""
    if not args.tiny:
        return DRAFTER_SHAPE
    path = folder / "tiny_drafter_shape.json"
    cfg = shape_config(DRAFTER_SHAPE, TINY_DRAFTER) | {"vocab_size": target.config.vocab_size}
    path.write_text(json.dumps(cfg))
    return str(path)


def _replay(
    target, name: str, config: dict, s: ServiceSettings, time_left, res: dict, key: str
) -> dict:
    # the cuda backend (eager on a CPU, as the decode stage; the exactness stage rehearses its
    # graphs), timed on a GPU even where its bf16 sample is off (decode.sample says)
    gpu = next(target.parameters()).device.type == "cuda"
    got = run_service(target, name, config, s, time_left, CudaBackend(graphs=gpu, trust=gpu))
    res["errors"] += [f"{key}: {e}" for e in service_errors(got)]  # named by the stage
    return got


def _projection(res: dict) -> dict:
    """:func:`projection` from the decode and drafter stages, for each drafter shape."""
    one = ((res.get("decode") or {}).get("rows") or {}).get("1")
    if not one:
        return {"skipped": "no decode figures"}
    out = {}
    for name, row in (res.get("drafters") or {}).items():
        if not isinstance(row, dict):
            continue
        out[name] = projection(
            one["step_ms"], one["verify16_ms"], row["packed_8_branches_ms"], row["block_ms"],
            PAPER["acceptance"], PAPER["hit_rate"],
        )  # fmt: skip
    return out


def _vllm(config, device, dtype, args, time_left, res: dict) -> dict:
    if importlib.util.find_spec("vllm") is None:  # before building a second target for it
        return {"skipped": "vLLM is not installed here (pip install -e '.[vllm]')"}
    target = st.build_model(config, device, dtype)
    try:
        got = run_vllm(target, 16, args.prompt_tokens, args.new_tokens, "self:2", time_left)
    finally:
        del target
    res["errors"] += [f"vllm {e}" for e in vllm_errors(got)]
    return got


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
