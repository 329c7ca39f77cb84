"""The engine under a closed-loop load, without HTTP: how its scheduling settings pay.

``clients`` requests are in flight at once, each a random prompt of ``input-len`` token ids and
``output-len`` new tokens with end-of-sequence ignored (``vllm bench serve``'s random dataset,
in process); a request that finishes is replaced at once until ``requests`` were sent. The
engine is the one ``d3d serve`` runs (a :class:`~d3d.engine.scheduler.Scheduler` over the
embedded target as :class:`~d3d.engine.front.Engine` loads it, mode ``ar``), stepped in this
thread, so what is measured is the scheduler and the
forward alone: no front, no client on the same cores. Each setting is a
``share:max_batch:max_chunk:short[:floor_s]`` string
(:class:`~d3d.engine.scheduler.PrefillBudget`; ``short=0``: prompts are read only in share-sized
chunks; ``floor_s``: the budget's default where left out), and the settings run alternately
``--repeats`` times on the same prompts (seeded by repeat), so the machine's drift falls on
all of them alike. Prints output tok/s, steps and median latency per run, the median per setting,
and writes them to ``--out``.

The target loads as ``d3d serve`` loads it, environment included (``D3D_FUSE=0``: without
vLLM's CPU kernels, ``D3D_PACK=0``: unpacked linear maps). ``--vllm`` adds vLLM's offline engine
(``LLM.generate`` over the same prompts, greedy, ``ignore_eos``, both cores as
:data:`eval.field_bench.VLLM_ENV` sets them) as one more setting, alternated with the others: it
takes every request at once, so compare it with ``--clients`` equal to ``--requests``.

Usage:
    python -m eval.engine_load --clients 64 --requests 64 --settings 2:64:512:0,2:64:512:512
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from d3d.backends.kv import default_kv_tokens
from d3d.config import ModelConfig
from d3d.decoding.proposers import ArProposer
from d3d.engine.front import Engine
from d3d.engine.request import GenRequest
from d3d.engine.scheduler import PrefillBudget, Scheduler


@dataclass(frozen=True)
class Setting:
    share: float
    max_batch: int
    max_chunk: int
    short: int
    floor_s: float = PrefillBudget().floor_s

    @classmethod
    def parse(cls, text: str) -> Setting:
        share, batch, chunk, short, *floor = text.split(":")
        extra = (float(floor[0]),) if floor else ()
        return cls(float(share), int(batch), int(chunk), int(short), *extra)

    @property
    def name(self) -> str:
        return f"{self.share:g}:{self.max_batch}:{self.max_chunk}:{self.short}:{self.floor_s:g}"


def run(engine: Engine, s: Setting, args: argparse.Namespace, seed: int) -> dict:
    """One closed-loop run: output tok/s, steps, median request latency."""
    sched = Scheduler(  # the service's scheduler, with these settings, eos ignored
        engine.target.model,
        set(),
        lambda req: ArProposer(),
        max_batch=s.max_batch,
        max_kv_tokens=default_kv_tokens(engine.target.model),
        prefill=PrefillBudget(
            share=s.share, max_chunk=s.max_chunk, short=s.short, floor_s=s.floor_s
        ),
    )
    prompts = iter(prompt_ids(args, seed))
    sent, tokens, latencies = 0, [0], []

    def send() -> None:
        nonlocal sent
        sent += 1
        t0 = time.perf_counter()
        ids = next(prompts)

        def on_tokens(chunk: list[int]) -> None:
            tokens[0] += len(chunk)

        def on_finish(stats, err, t0=t0) -> None:
            if err is not None:
                raise RuntimeError(f"a request failed: {err}")
            latencies.append(time.perf_counter() - t0)
            if sent < args.requests:
                send()

        sched.add(
            GenRequest(ids, args.output_len, mode="ar", on_tokens=on_tokens, on_finish=on_finish)
        )

    for _ in range(min(args.clients, args.requests)):
        send()
    t0, steps = time.perf_counter(), 0
    while not sched.idle:
        sched.step()
        steps += 1
    seconds = time.perf_counter() - t0
    return {
        "setting": s.name,
        "tokens_per_s": tokens[0] / seconds,
        "tokens": tokens[0],
        "seconds": seconds,
        "steps": steps,
        "latency_p50_s": statistics.median(latencies),
    }


def prompt_ids(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """The run's ``requests`` random prompts of ``input_len`` ids, seeded: the same for every
    setting and for vLLM."""
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.requests)
    ]


def run_vllm(llm, args: argparse.Namespace, seed: int) -> dict:
    """The same prompts as :func:`run` with ``seed``, all at once through vLLM's ``LLM``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids(args, seed)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "setting": "vllm",
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "steps": None,
        "latency_p50_s": seconds,
    }


def vllm_engine(model_dir: str):
    """vLLM's offline engine on the embedded model's folder, fp32, both cores."""
    import os

    from eval.field_bench import VLLM_ENV

    os.environ.update(VLLM_ENV)
    from vllm import LLM

    return LLM(model=model_dir, dtype="float32", seed=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default", help="a Hugging Face id or directory")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--settings", default="2:64:512:0,2:64:512:512")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="eval/results/engine_load.json")
    p.add_argument("--vllm", action="store_true", help="add vLLM's offline engine (docstring)")
    args = p.parse_args(argv)
    settings = [Setting.parse(x) for x in args.settings.split(",")]
    engine = Engine.from_config(ModelConfig.from_env(target=args.target), with_drafter=False)
    llm = None
    if args.vllm:
        from eval.field_bench import MODEL_DIR

        llm = vllm_engine(str(MODEL_DIR))
    runs = []
    for rep in range(args.repeats):
        for s in [*settings, *([None] if llm is not None else [])]:
            r = run(engine, s, args, seed=rep) if s is not None else run_vllm(llm, args, rep)
            runs.append(r)
            print(
                f"[{rep}] {r['setting']}: {r['tokens_per_s']:.1f} tok/s, {r['steps']} steps, "
                f"latency p50 {r['latency_p50_s']:.2f} s",
                flush=True,
            )
    names = [s.name for s in settings] + (["vllm"] if llm is not None else [])
    medians = {
        n: statistics.median(r["tokens_per_s"] for r in runs if r["setting"] == n) for n in names
    }
    base = medians[settings[0].name]
    for name, tps in medians.items():
        print(f"{name}: median {tps:.1f} tok/s ({tps / base:.2f}x {settings[0].name})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "meta": vars(args),
                "settings": [asdict(s) for s in settings],
                "runs": runs,
                "medians": medians,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
