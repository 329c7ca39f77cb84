"""Copy rounds in the engine the service runs: the same QA prompts with and without them.

The six needle questions of the 4k essay (:mod:`eval.longbench.qa_bench`) are compressed at keep
0.1 as ``/qa`` does; the engine's scheduler, warmed up as the service's worker does (an ``ar``
and a ``sync`` generation), answers every prompt alone with copy rounds allowed and not
(``--repeats`` times, alternating) and all six at once. Reports medians, the ratio, rounds per answer and whether the
answers are identical (they must be: both are greedy decoding of the target). It times: run it
with nothing else busy on the machine:

    python -m eval.batch_copy --out eval/results/serve
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from compression.compressor import CompressionConfig
from compression.qa import DocumentQA
from d3d.config import ModelConfig
from d3d.engine import Engine, GenRequest, Scheduler
from eval.longbench.qa_bench import NEEDLES, document


def run(
    engine: Scheduler, prompts: list[list[int]], new_tokens: int, copy: bool
) -> tuple[float, list, list]:
    """Answer ``prompts`` together; (seconds, token lists, stats)."""
    outs: list[list[int]] = [[] for _ in prompts]
    stats: list = [None] * len(prompts)
    for i, p in enumerate(prompts):

        def finish(s, _err, i=i):
            stats[i] = s

        engine.add(
            GenRequest(
                list(p),
                new_tokens,
                mode="auto",
                copy=copy,
                on_tokens=outs[i].extend,
                on_finish=finish,
            )
        )
    t0 = time.perf_counter()
    while not engine.idle:
        engine.step()
    return time.perf_counter() - t0, outs, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.batch_copy", description=__doc__)
    p.add_argument("--repeats", type=int, default=2, help="alone runs per prompt and engine")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--out", default="eval/results/serve")
    args = p.parse_args(argv)
    eng = Engine.from_config(ModelConfig())
    qa = DocumentQA(eng, CompressionConfig())
    tok = qa.tokenizer
    text = document(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), 4)
    prompts = [qa.compress(qa.parts(text, q), 0.1).parts.ids for _, q, _ in NEEDLES]
    be = eng.scheduler()
    hello = eng.encode("Say hello.", True)
    eng.calibrate()
    for mode in ("ar", "sync"):  # the service worker's warm-up
        be.add(GenRequest(hello, max_new_tokens=8 if mode == "ar" else 24, mode=mode))
        while not be.idle:
            be.step()
    alone: dict[bool, list[float]] = {True: [], False: []}
    rounds: dict[bool, list[int]] = {True: [], False: []}
    answers: dict[tuple[bool, int], list[int]] = {}
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for copy in (True, False):
                s, out, st = run(be, [prompt], args.max_new_tokens, copy)
                alone[copy].append(s)
                rounds[copy].append(st[0].rounds)
                answers.setdefault((copy, i), out[0])
    together = {
        c: [run(be, prompts, args.max_new_tokens, c)[0] for _ in range(3)] for c in (True, False)
    }
    med = {c: statistics.median(alone[c]) for c in (True, False)}
    both = {c: statistics.median(together[c]) for c in (True, False)}
    doc = {
        "command": "python -m eval.batch_copy " + " ".join(argv or sys.argv[1:]),
        "prompt_tokens": [len(x) for x in prompts],
        "alone_s": {"copy": med[True], "plain": med[False], "speedup": med[False] / med[True]},
        "alone_rounds": {"copy": rounds[True], "plain": rounds[False]},
        "six_together_s": {
            "copy": both[True],
            "plain": both[False],
            "speedup": both[False] / both[True],
        },
        "identical": all(answers[(True, i)] == answers[(False, i)] for i in range(len(prompts))),
        "answers": [tok.decode(answers[(True, i)]) for i in range(len(prompts))],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_copy.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: v for k, v in doc.items() if k != "answers"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
