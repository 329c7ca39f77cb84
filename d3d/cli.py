"""The ``d3d`` command: thin argument parsing that builds configs and calls the library.

Subcommands register themselves: each package that adds commands declares an entry point in the
``d3d.commands`` group (see ``pyproject.toml``) naming a ``register(subparsers)`` function, so the
core library never names the packages that use it (``compression``, ``eval``, ``app``). The parser
a module adds sets ``func`` to a function taking the parsed namespace and returning an exit code.
Bad input is a one-line ``d3d: error: ...`` on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from importlib.metadata import entry_points

from d3d.config import BACKENDS, MODES, ConfigError, DecodeConfig, ModelConfig, SamplingConfig
from d3d.model.drafter import DrafterError
from d3d.model.load import ModelLoadError
from d3d.replay.spec import is_replay

COMMAND_GROUP = "d3d.commands"

USER_ERRORS = (ConfigError, ModelLoadError, DrafterError, FileNotFoundError, ValueError)


def add_model_args(p: argparse.ArgumentParser, remember_costs: bool = False) -> None:
    """Flags shared by every command that loads models. ``remember_costs``: the command keeps
    ``auto``'s measured costs between processes (one-shot commands; not benchmarks, which
    start fresh) unless ``--fresh-costs``."""
    g = p.add_argument_group("models")
    if remember_costs:
        g.add_argument(
            "--fresh-costs",
            action="store_true",
            help="measure decoding costs afresh instead of starting from what the last process "
            "on this host measured (kept under $D3D_COSTS_DIR or ~/.cache/d3d/costs)",
        )
        p.set_defaults(remember_costs=True)
    g.add_argument(
        "--target", default=None, help="target spec: default, HF id, directory or .gguf file"
    )
    g.add_argument(
        "--drafter",
        default=None,
        help="drafter spec: default, self:N, self:i,j,k or a checkpoint dir; or "
        "replay:TAU[:HIT][:SHAPE], a measurement instrument, never a drafter to serve with: "
        "the target's own recorded greedy output corrupted to a mean acceptance TAU (branch "
        "hit rate HIT, default 0.78; SHAPE: a drafter whose forwards run for real beside it; "
        "d3d generate only), docs/replay.md",
    )
    g.add_argument("--device", default=None, help="target device (cpu, cuda, cuda:0)")
    g.add_argument(
        "--drafter-device",
        default=None,
        help="drafter device: cuda:N, cpu (a thread beside the target), or cpu:CORES (its own "
        "process on those cores, e.g. cpu:1); default for async/auto on a CPU host with 2+ "
        "cores: its own process on the last core",
    )
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--backend",
        default=None,
        choices=list(BACKENDS),
        help="how the target runs its steps (D3D_BACKEND): auto (the default: cuda on a GPU, "
        "cpu on the CPU), reference (the model's own forward, PyTorch attention), cpu (every "
        "CPU tuning), cuda (fixed-slot KV, decode steps as CUDA graphs)",
    )
    g.add_argument(
        "--max-kv-tokens",
        type=int,
        default=None,
        help="the target's KV budget in tokens over all requests (D3D_MAX_KV_TOKENS; default: "
        "a share of the device's free memory); a request that can never fit is refused",
    )
    g.add_argument(
        "--prefix-cache",
        default=None,
        help="memory for the target's KV of shared prompt prefixes: auto (10%% of the free "
        "memory on the target's device, the default), a share (25%%), a size (4GiB) or tokens "
        "(32768tok)",
    )
    g.add_argument(
        "--no-pack",
        action="store_true",
        help="keep float32 CPU linear maps in PyTorch's own layout (default: prepacked for "
        "oneDNN, faster decode steps, verify forwards and prefill)",
    )
    g.add_argument(
        "--no-fuse",
        action="store_true",
        help="run a CPU target in PyTorch's own kernels and Hugging Face's forward (default: "
        "vLLM's CPU kernels for its RMSNorm, rotary embedding, attention and packed linear maps, "
        "and a lean forward of a Llama-family target in them, where vLLM's CPU build is "
        "installed)",
    )


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The models a command loads. A replay drafter (a measurement instrument) only where the
    command says it runs one (``d3d generate``)."""
    cfg = _model_config(args)
    if is_replay(cfg.drafter) and not getattr(args, "runs_replay", False):
        raise ConfigError(
            f"drafter: {cfg.drafter} is a measurement instrument that d3d generate --mode sync "
            "or async runs; this command cannot use it"
        )
    return cfg


def _model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig.from_env(
        target=args.target,
        drafter=args.drafter,
        target_device=args.device,
        drafter_device=args.drafter_device,
        dtype=args.dtype,
        threads=args.threads,
        backend=getattr(args, "backend", None),
        pack=False if getattr(args, "no_pack", False) else None,
        fuse=False if getattr(args, "no_fuse", False) else None,
        costs_dir=_costs_dir(args),
        max_kv_tokens=getattr(args, "max_kv_tokens", None),
        prefix_cache=getattr(args, "prefix_cache", None),
    )


def _costs_dir(args: argparse.Namespace) -> str | None:
    """Where a one-shot command keeps auto's costs (None: it does not, or the environment says)."""
    if not getattr(args, "remember_costs", False) or getattr(args, "fresh_costs", False):
        return None
    from d3d.model.load import cache_dir

    return os.environ.get("D3D_COSTS_DIR") or str(cache_dir() / "costs")


def add_decode_args(p: argparse.ArgumentParser, default_max: int = 256) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument(
        "--mode",
        default="auto",
        choices=list(MODES),
        help="ar: the target alone; sync: draft then verify; async: blocks drafted during "
        "verification on the drafter's own core/GPU; auto (default): speculation only where "
        "measured costs say it pays",
    )
    g.add_argument("--max-new-tokens", type=int, default=default_max)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument(
        "--no-copy",
        action="store_true",
        help="auto: never draft by copying the request's own text (prompt lookup)",
    )


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
        chat_template=not args.no_chat_template,
        copy=not args.no_copy,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from d3d.engine import Engine

    dcfg = decode_config(args)
    mcfg = model_config(args)
    if is_replay(mcfg.drafter) and dcfg.mode not in ("sync", "async"):
        raise ConfigError(
            f"mode: the replay drafter (a measurement instrument) runs with --mode sync or "
            f"async, got {dcfg.mode}"
        )
    t0 = time.perf_counter()
    engine = Engine.from_config(
        mcfg,
        with_drafter=dcfg.mode != "ar",
        start_worker=dcfg.mode in ("async", "auto"),
    )
    if dcfg.mode == "auto":
        engine.calibrate()  # a fresh host: auto decides from the first token
    load_s = time.perf_counter() - t0
    try:
        if engine.drafter is not None and engine.drafter.block_size != dcfg.block_size:
            raise ConfigError(
                f"block_size: the drafter was built for {engine.drafter.block_size}, got {dcfg.block_size}"
            )
        return _generate(engine, args, dcfg, load_s)
    finally:
        engine.close()


def _generate(engine, args: argparse.Namespace, dcfg: DecodeConfig, load_s: float) -> int:
    if args.compare or is_replay(engine.model_cfg.drafter):  # a replay needs ar's recording
        return _compare(engine, args.prompt, dcfg, args.json)
    if args.json:
        gen = engine.generate(args.prompt, dcfg)
        out = gen.to_dict()
        out["load_seconds"] = round(load_s, 3)
        print(json.dumps(out))
        return 0
    from d3d.decoding.stats import DecodeStats

    stats = DecodeStats(mode=dcfg.mode)
    ids: list[int] = []
    printed = ""
    for chunk in engine.stream(engine.encode(args.prompt, dcfg.chat_template), dcfg, stats):
        ids += chunk
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        sys.stdout.write(text[len(printed) :])
        sys.stdout.flush()
        printed = text
    s = stats
    print(
        f"\n\n[{s.mode}] {s.num_tokens} tokens in {s.decode_seconds:.2f} s "
        f"({s.tokens_per_second:.1f} tok/s), prefill {s.prefill_seconds:.2f} s, "
        f"acceptance length {s.acceptance_length:.2f} over {s.num_drafts} drafts"
        + (
            f", branch hit rate {s.hit_rate:.0%} ({s.branches_per_round:.1f} branches/round)"
            if s.branch_hits + s.branch_misses
            else ""
        )
        + (f"; {s.spec_tokens} tokens speculative, {s.ar_tokens} plain" if s.mode == "auto" else "")
        + (
            f" ({s.copy_accepted_tokens} drafts copied from the text, {s.copy_drafts} copy rounds)"
            if s.copy_drafts
            else ""
        ),
        file=sys.stderr,
    )
    return 0


def _compare(engine, prompt: str, dcfg: DecodeConfig, as_json: bool) -> int:
    """Run the target alone, then the chosen mode, on the same prompt; print both and the ratio."""
    from dataclasses import replace

    # Nothing may be charged to whichever mode runs first: the drafter process loads its models
    # (beside the target, on the same cores) before anything is timed, and a short warm-up takes
    # the process's first forwards (page faults, kernels built for new shapes).
    if dcfg.mode in ("async", "auto"):
        engine.worker()
    engine.generate(prompt, replace(dcfg, mode="ar", max_new_tokens=4))
    ar = engine.generate(prompt, replace(dcfg, mode="ar"))
    spec = engine.generate(prompt, dcfg if dcfg.mode != "ar" else replace(dcfg, mode="sync"))
    speedup = (
        ar.stats.decode_seconds / spec.stats.decode_seconds if spec.stats.decode_seconds else 0.0
    )
    identical = ar.token_ids == spec.token_ids
    instrument = {"drafter": spec.stats.drafter} if spec.stats.drafter else {}
    if as_json:
        print(
            json.dumps(
                {
                    **instrument,
                    "ar": ar.to_dict(),
                    spec.stats.mode: spec.to_dict(),
                    "speedup": round(speedup, 3),
                    "identical": identical,
                }
            )
        )
        return 0
    print(spec.text)
    print(
        "\n| mode | tokens | decode s | tok/s | acceptance length | tokens speculative / plain "
        "| copied drafts accepted (rounds) |"
        "\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for g in (ar, spec):
        s = g.stats
        print(
            f"| {s.mode} | {s.num_tokens} | {s.decode_seconds:.2f} | {s.tokens_per_second:.1f} "
            f"| {s.acceptance_length:.2f} | {s.spec_tokens} / {s.ar_tokens} "
            f"| {s.copy_accepted_tokens} ({s.copy_drafts}) |"
        )
    print(f"\nspeed-up {speedup:.2f}x; output identical to the target alone: {identical}")
    s = spec.stats
    if s.branch_hits + s.branch_misses:
        print(f"branch hit rate {s.hit_rate:.0%} ({s.branches_per_round:.1f} branches/round)")
    if s.drafter:
        print(
            f"drafter: {s.drafter}: the target's own recorded output, corrupted to a "
            "set acceptance; it measures the engine, not a drafter"
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate an answer with speculative decoding")
    p.add_argument("prompt", help="the user prompt (wrapped in the chat template)")
    add_model_args(p, remember_costs=True)
    add_decode_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the target alone and print both, with the speed-up (always, with a "
        "replay drafter: its ar run is the recording)",
    )
    p.set_defaults(func=cmd_generate, runs_replay=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="d3d",
        description="D3D: lossless speculative decoding and prompt compression with a block drafter.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        try:
            register = ep.load()
        except Exception as exc:  # one broken package must not take every command down
            print(f"d3d: warning: commands from {ep.value} unavailable: {exc}", file=sys.stderr)
            continue
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a command that starts copies
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )
    if not args.verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        print(f"d3d: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
