"""``d3d data`` on the own engine against ``d3d data --engine vllm``, side by side.

One process, the same prompts (spread over the shared general prompt set: code, passage
questions, instructions, word problems), greedy answers, the same batch size:

1. the own engine's scheduler (:class:`d3d.training.responses.EngineResponder`);
2. vLLM (:class:`d3d.training.vllm_responses.VllmResponder`; eager on a CPU).

Both write their records through :func:`d3d.training.responses.generate_data`; the report counts
the records that are equal field for field, and gives each path's decoding time (what
``generate_data`` reports) and its start (loading, for vLLM also its engine processes). Read the
ratio, not the absolute figures, and run it with nothing else busy::

    python -m eval.data_vllm --n 64 --max-new-tokens 128 --out eval/results/data_vllm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from d3d.config import ModelConfig
from d3d.engine import Engine
from d3d.training.data import read_many
from d3d.training.responses import DataConfig, generate_data
from eval.data_speed import mixed_prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.data_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target", default="default")
    p.add_argument("--source", default="general", help="prompt source (d3d.training.sources)")
    p.add_argument("--n", type=int, default=64, help="prompts")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="eval/results/data_vllm.json")
    p.add_argument("--compile", action="store_true", help="vLLM compiled (default: eager)")
    args = p.parse_args(argv)
    from d3d.training.vllm_responses import VllmResponder

    prompts = mixed_prompts(args.n, args.source)
    cfg = DataConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch,
                     max_prompt_tokens=1 << 20)  # fmt: skip
    mcfg = ModelConfig(target=args.target)
    rows, records = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("own engine", "vllm"):
            t0 = time.perf_counter()
            source = (
                Engine.from_config(mcfg, with_drafter=False)
                if name == "own engine"
                else VllmResponder(mcfg, args.batch, eager=not args.compile)
            )
            if name == "vllm":
                source.start()  # timed as its start, not as decoding
            start_s = time.perf_counter() - t0
            out = Path(tmp) / f"{name.replace(' ', '_')}.jsonl"
            report = generate_data(source, prompts, out, cfg, progress=False)
            records[name] = {r["id"]: r for r in read_many(out)}
            rows.append({"path": name, "records": report.written,
                         "tokens": report.response_tokens, "start_s": round(start_s, 2),
                         "decode_s": round(report.seconds, 2),
                         "tokens_per_second": round(report.tokens_per_second, 2)})  # fmt: skip
    own, fast = records["own engine"], records["vllm"]
    equal = sum(fast.get(k) == r for k, r in own.items())
    result = {
        "command": "python -m eval.data_vllm " + " ".join(sys.argv[1:] if argv is None else argv),
        "target": args.target, "n_prompts": len(prompts), "batch": args.batch,
        "max_new_tokens": args.max_new_tokens, "vllm_compiled": args.compile, "rows": rows,
        "vllm_vs_own_decode": round(rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"], 3),
        "vllm_vs_own_with_start": round((rows[0]["start_s"] + rows[0]["decode_s"])
                                        / (rows[1]["start_s"] + rows[1]["decode_s"]), 3),
        "records_equal": f"{equal}/{len(own)}",
    }  # fmt: skip
    print(
        "| path | records | tokens | start s | decode s | tokens/s |\n|---|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(f"| {r['path']} | {r['records']} | {r['tokens']} | {r['start_s']} | "
              f"{r['decode_s']} | {r['tokens_per_second']} |")  # fmt: skip
    print(
        f"\nvLLM / own engine: {result['vllm_vs_own_decode']}x decoding, "
        f"{result['vllm_vs_own_with_start']}x with start; records equal: {result['records_equal']}"
    )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
