"""``d3d bench``: the forward passes that decide whether speculation pays, timed side by side.

One run, one process, interleaved repeats: a 1-token target decode step, a B-token target verify
forward, and a drafter block forward, all after the same cached context. It prints medians and
ratios (verify / step tells how many accepted tokens a round needs to break even; drafter /
verify tells whether branch drafting fits inside verification) and can write them as JSON.
Interleaving the three measurements spreads the noise of a shared machine over all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from d3d.backends.hf import trim_cache, with_cache
from d3d.model.drafter import D3DDrafter


@dataclass(frozen=True)
class MicroBench:
    context: int
    block_size: int
    repeats: int
    threads: int
    target_step_ms: float
    target_verify_ms: float
    drafter_block_ms: float
    drafter_layers: int

    @property
    def verify_over_step(self) -> float:
        return self.target_verify_ms / self.target_step_ms

    @property
    def drafter_over_verify(self) -> float:
        return self.drafter_block_ms / self.target_verify_ms

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verify_over_step"] = round(self.verify_over_step, 3)
        out["drafter_over_verify"] = round(self.drafter_over_verify, 3)
        return out

    def table(self) -> str:
        rows = [
            ("target decode step (1 token)", self.target_step_ms, 1.0),
            (
                f"target verify forward ({self.block_size} tokens)",
                self.target_verify_ms,
                self.verify_over_step,
            ),
            (
                f"drafter block forward ({self.drafter_layers} layers, {self.block_size} slots)",
                self.drafter_block_ms,
                self.drafter_block_ms / self.target_step_ms,
            ),
        ]
        lines = ["| forward | median ms | x decode step |", "|---|---:|---:|"]
        lines += [f"| {name} | {ms:.1f} | {ratio:.2f} |" for name, ms, ratio in rows]
        lines.append(
            f"\ncontext {self.context} tokens, {self.repeats} repeats, {self.threads} thread(s); "
            f"drafter / verify = {self.drafter_over_verify:.2f}"
        )
        return "\n".join(lines)


@torch.inference_mode()
def run_micro(
    model, drafter: D3DDrafter, context: int = 400, repeats: int = 30, seed: int = 0
) -> MicroBench:
    """Time the three forwards after a random ``context``-token prefix (medians over repeats)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    b = drafter.block_size
    t_cache = DynamicCache()
    model(input_ids=ids, **with_cache(model, t_cache))
    d_cache = DynamicCache()
    drafter.encode(ids[0].tolist(), d_cache)
    step = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
    block = torch.randint(0, vocab, (1, b), generator=gen).to(device)

    def target_forward(x: torch.Tensor) -> None:
        s = context
        pos = torch.arange(s, s + x.shape[1], device=device).unsqueeze(0)
        model(input_ids=x, position_ids=pos, **with_cache(model, t_cache))
        trim_cache(t_cache, x.shape[1])

    timings: dict[str, list[float]] = {"step": [], "verify": [], "draft": []}
    jobs = {
        "step": lambda: target_forward(step),
        "verify": lambda: target_forward(block),
        "draft": lambda: drafter.block_scores(int(ids[0, -1]), d_cache),
    }
    for fn in jobs.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in jobs.items():
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timings[name].append((time.perf_counter() - t0) * 1000)
    med = {k: statistics.median(v) for k, v in timings.items()}
    return MicroBench(
        context=context,
        block_size=b,
        repeats=repeats,
        threads=torch.get_num_threads(),
        target_step_ms=round(med["step"], 3),
        target_verify_ms=round(med["verify"], 3),
        drafter_block_ms=round(med["draft"], 3),
        drafter_layers=len(drafter.meta.layers),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from d3d.cli import model_config
    from d3d.engine import Engine

    engine = Engine.from_config(model_config(args))
    assert engine.drafter is not None
    result = run_micro(engine.target.model, engine.drafter, args.context, args.repeats)
    print(result.table())
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {"command": "d3d bench", "target": engine.target.spec, **result.to_dict()},
                f,
                indent=2,
            )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from d3d.cli import add_model_args

    p = sub.add_parser("bench", help="time a decode step, a verify forward and a drafter block")
    add_model_args(p)
    p.add_argument("--context", type=int, default=400, help="cached context length (tokens)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=cmd_bench)
