"""Load test of the service on loopback: 1, 4, 16 and 64 concurrent clients.

Starts ``d3d serve`` (or uses ``--url``), then for each concurrency level C runs C closed-loop
clients that send streaming greedy chat completions (the OpenAI wire format, parsed with httpx)
over a fixed set of prompts. The C = 1 level sends every prompt once, alone: its answers are the
references; at every level each answer must equal its prompt's reference (batching is lossless),
no request may be lost and none may get a 5xx. Per level it reports aggregate generated tokens/s,
time to first token and latency (p50 / p99), and the throughput ratio to C = 1 measured in the
same run. Writes ``OUT/load.json``, ``OUT/load.md`` and ``OUT/serve_load.png``.

Usage: python -m eval.serve_load --out eval/results/serve [--levels 1,4,16,64] [--max-tokens 64]
(it times: run it with nothing else busy on the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

PROMPTS = [
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the boiling point of water at sea level?",
    "Give three tips for writing clear emails.",
    "Why is the sky blue? Answer briefly.",
    "Name the planets of the solar system in order.",
    "What does HTTP stand for, and what is it used for?",
    "Write a Python function that returns the square of a number.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is photosynthesis?",
    "List four common sorting algorithms.",
    "How do vaccines work? Keep it short.",
    "Translate 'good morning' into French, Spanish and German.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery and explain it.",
    "What are prime numbers? Give five examples.",
]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, extra: dict | None = None
) -> dict:
    """One streaming greedy chat request (``extra``: more body fields, e.g. the mode)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    t0 = time.perf_counter()
    ttft, text, usage, status = None, [], None, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            status = r.status_code
            if status != 200:
                await r.aread()
                return {"prompt": prompt, "status": status, "error": r.text[:200]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"prompt": prompt, "status": 500, "error": str(chunk["error"])[:200]}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices", []):
                    piece = ch.get("delta", {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
    except httpx.HTTPError as exc:
        return {"prompt": prompt, "status": status or -1, "error": repr(exc)[:200]}
    return {
        "prompt": prompt,
        "status": status,
        "text": "".join(text),
        "tokens": usage["completion_tokens"] if usage else 0,
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "latency": time.perf_counter() - t0,
    }


async def run_level(url: str, clients: int, per_client: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:

        async def worker(c: int) -> list[dict]:
            out = []
            for i in range(per_client):
                prompt = PROMPTS[(c * per_client + i) % len(PROMPTS)]
                out.append(await one_request(client, url, prompt, max_tokens))
            return out

        t0 = time.perf_counter()
        results = [
            r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs
        ]
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200 and "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "clients": clients,
        "requests": len(results),
        "ok": len(ok),
        "server_errors": sum(1 for r in results if r["status"] >= 500 or r["status"] < 0),
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50": percentile([r["ttft"] for r in ok], 0.5),
        "ttft_p99": percentile([r["ttft"] for r in ok], 0.99),
        "latency_p50": percentile([r["latency"] for r in ok], 0.5),
        "latency_p99": percentile([r["latency"] for r in ok], 0.99),
        "results": results,
    }


@dataclass(frozen=True)
class Served:
    """A ``d3d serve`` started by :func:`served`: its URL, its ``/ready`` reply, its arguments
    and its process id (its children, a drafter worker for one, are its descendants)."""

    url: str
    ready: dict
    args: list[str]
    pid: int


@contextlib.contextmanager
def served(flags: list[str], port: int, log: Path) -> Iterator[Served]:
    """``d3d serve --port PORT FLAGS`` started (its output in ``log``), ready, and stopped when
    the block ends."""
    args = ["d3d", "serve", "--port", str(port), *flags]
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            yield Served(url, wait_ready(url, proc=proc, log=log), args, proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)


def wait_ready(
    url: str, timeout: float = 600, proc: subprocess.Popen | None = None, log: Path | None = None
) -> dict:
    """The server's ``/ready`` reply once it is ready (``proc``: the server process, whose exit
    ends the wait at once)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"d3d serve exited with code {proc.returncode} (its output: {log})")
        try:
            r = httpx.get(url + "/ready", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def write_report(out: Path, levels: list[dict], meta: dict) -> None:
    base = levels[0]["tokens_per_s"]
    rows = [
        "| clients | requests | ok | 5xx | identical to alone | tokens/s | x 1 client | TTFT p50 s | TTFT p99 s | latency p50 s | latency p99 s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        rows.append(
            f"| {lv['clients']} | {lv['requests']} | {lv['ok']} | {lv['server_errors']} | "
            f"{lv['identical']}/{lv['ok']} | {lv['tokens_per_s']:.1f} | {lv['tokens_per_s'] / base:.2f} | "
            f"{lv['ttft_p50']:.2f} | {lv['ttft_p99']:.2f} | {lv['latency_p50']:.2f} | {lv['latency_p99']:.2f} |"
        )
    (out / "load.md").write_text(
        f"Command: `{meta['command']}`\n\nServer: {json.dumps(meta['server'])}\n\n"
        + "\n".join(rows)
        + "\n"
    )
    slim = [{k: v for k, v in lv.items() if k != "results"} for lv in levels]
    (out / "load.json").write_text(
        json.dumps({"meta": meta, "levels": slim, "raw": levels}, indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [lv["clients"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(cs, [lv["tokens_per_s"] for lv in levels], "o-", label="aggregate tokens/s")
    a.plot(cs, [base * c for c in cs], ":", color="grey", label="linear in clients")
    a.set_xscale("log", base=2), a.set_xlabel("concurrent clients"), a.set_ylabel("tokens/s")
    a.set_ylim(0, max(lv["tokens_per_s"] for lv in levels) * 1.3), a.legend(), a.grid(alpha=0.3)
    for key, style in (
        ("latency_p50", "o-"),
        ("latency_p99", "s--"),
        ("ttft_p50", "^-"),
        ("ttft_p99", "v--"),
    ):
        b.plot(cs, [lv[key] for lv in levels], style, label=key.replace("_", " "))
    b.set_xscale("log", base=2), b.set_xlabel("concurrent clients"), b.set_ylabel("seconds")
    b.legend(), b.grid(alpha=0.3)
    fig.suptitle("d3d serve on loopback (SmolLM2-135M, CPU, greedy, streaming chat)")
    fig.tight_layout()
    fig.savefig(out / "serve_load.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="eval/results/serve")
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--levels", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue)]
    flags += ["--threads", str(args.threads)] if args.threads else []
    with contextlib.ExitStack() as stack:
        if args.url is None:
            srv = stack.enter_context(served(flags, args.port, out / "server.log"))
            url, server = srv.url, srv.ready
        else:
            url, server = args.url, wait_ready(args.url)
        levels_n = [int(x) for x in args.levels.split(",")]
        levels, refs = [], {}
        for c in levels_n:
            # C = 1 sends every prompt alone once (the references); higher levels keep every
            # client busy for at least two requests so the batch stays full.
            per_client = len(PROMPTS) if c == 1 else max(len(PROMPTS), 2 * c) // c
            lv = asyncio.run(run_level(url, c, per_client, args.max_tokens))
            if c == 1:
                refs = {r["prompt"]: r.get("text") for r in lv["results"]}
            lv["identical"] = sum(
                1 for r in lv["results"] if "text" in r and r["text"] == refs.get(r["prompt"])
            )
            lv["mismatches"] = [
                r["prompt"]
                for r in lv["results"]
                if "text" in r and r["text"] != refs.get(r["prompt"])
            ]
            levels.append(lv)
            print(
                f"clients {c:3d}: {lv['ok']}/{lv['requests']} ok, {lv['server_errors']} 5xx, "
                f"{lv['identical']} identical, {lv['tokens_per_s']:.1f} tok/s, "
                f"TTFT p50 {lv['ttft_p50']:.2f}s, latency p50 {lv['latency_p50']:.2f}s p99 {lv['latency_p99']:.2f}s",
                flush=True,
            )
        meta = {
            "command": "python -m eval.serve_load "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "max_tokens": args.max_tokens,
            "server": {
                k: server.get(k) for k in ("model", "target_device", "dtype", "drafter", "warmup")
            },
            "metrics_after": httpx.get(url + "/metrics").text.count("\n"),
        }
        write_report(out, levels, meta)
        print((out / "load.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
