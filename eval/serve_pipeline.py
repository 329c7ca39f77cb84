"""The service's asynchronous pipeline and its fairness, measured from outside over HTTP.

Starts ``d3d serve --threads 1 --drafter DRAFTER`` (the two-device layout on a CPU host: the
target on one core, the drafter process on the other) and runs two scenarios, each side by
side in one run:

1. **Four concurrent chat requests** per mode (``ar``, ``sync``, ``async``; greedy, alternating
   over ``--repeats`` rounds): wall time for the four, tokens/s, whether every answer equals the
   ``ar`` one, and for ``async`` the branch hits per request and, over the hit rounds, the whole
   engine step against the batched verify forward alone (``hit_step_seconds`` /
   ``hit_step_verify_seconds`` over the steps where every row's block was ready: 1.0 means
   the drafting hid completely).
2. **A short chat request behind six documents**: a 16-token chat alone (median of three), then
   six ~3,000-word documents posted to ``/qa`` at once and the same chat right after them: its
   latency against alone, and the time until all six answers are back. Fresh documents each
   repeat (the document cache would otherwise serve them).

Writes ``OUT/pipeline.json`` and prints a table. It times: run it with nothing else busy.

    python -m eval.serve_pipeline --out eval/results/serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from eval.serve_load import served

ESSAYS = Path(__file__).resolve().parents[2] / "shared" / "data" / "paul_graham_essays"
CHAT_PROMPTS = [
    "Explain what a hash table is in two sentences.",
    "Write a Python function that returns the square of a number.",
    "Name the planets of the solar system in order.",
    "Give three tips for writing clear emails.",
]
SHORT = "What is the capital of France?"


def documents(n: int, words: int = 3000) -> list[str]:
    """``n`` different documents of ``words`` words, cut from the longest essays."""
    paths = sorted(ESSAYS.glob("*.txt"), key=lambda p: -len(p.read_text().split()))
    docs = [" ".join(p.read_text().split()[:words]) for p in paths[:n]]
    if len(docs) < n:
        raise SystemExit(f"need {n} essays in {ESSAYS}, found {len(docs)}")
    return docs


async def chat(client: httpx.AsyncClient, url: str, prompt: str, mode: str, tokens: int) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "speculative": {"mode": mode},
    }
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    return {
        "text": out["choices"][0]["message"]["content"],
        "seconds": time.perf_counter() - t0,
        "tokens": out["usage"]["completion_tokens"],
        "speculative": out.get("speculative", {}),
    }


async def qa(client: httpx.AsyncClient, url: str, document: str) -> dict:
    body = {"document": document, "question": "What is the main argument of this essay?"}
    t0 = time.perf_counter()
    r = await client.post(url + "/qa", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    spec = out.get("speculative", {})
    return {
        "seconds": time.perf_counter() - t0,
        "answer": out["answer"],
        "timings": out.get("timings", {}),
        "spec_tokens": spec.get("spec_tokens"),
        "copy_drafts": spec.get("copy_drafts"),
    }


async def four_at_once(url: str, mode: str, tokens: int) -> dict:
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(chat(client, url, p, mode, tokens) for p in CHAT_PROMPTS))
        return {"wall_s": time.perf_counter() - t0, "requests": outs}


async def behind_documents(url: str, docs: list[str], tokens: int) -> dict:
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        posted = [asyncio.create_task(qa(client, url, d)) for d in docs]
        await asyncio.sleep(0.2)  # the documents are in; now the short request
        short = await chat(client, url, SHORT, "auto", tokens)
        answers = await asyncio.gather(*posted)
        return {"short": short, "six_s": time.perf_counter() - t0, "qa": answers}


def scenario_modes(url: str, repeats: int, tokens: int) -> dict:
    runs: dict[str, list[dict]] = {"ar": [], "sync": [], "async": []}
    asyncio.run(four_at_once(url, "async", 8))  # warm the worker's path once
    for _ in range(repeats):
        for mode in runs:
            runs[mode].append(asyncio.run(four_at_once(url, mode, tokens)))
    ref = [r["text"] for r in runs["ar"][0]["requests"]]
    out: dict = {}
    for mode, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        toks = sum(q["tokens"] for q in rs[0]["requests"])
        spec = [q["speculative"] for r in rs for q in r["requests"]]
        out[mode] = {
            "wall_s_median": wall,
            "tokens_per_s": toks / wall,
            "identical_to_ar": all([q["text"] for q in r["requests"]] == ref for r in rs),
            "branch_hits": [s.get("branch_hits", 0) for s in spec],
            "branch_misses": [s.get("branch_misses", 0) for s in spec],
            "acceptance_length": [s.get("acceptance_length", 1.0) for s in spec],
        }
        if mode == "async":
            hit_step = sum(s.get("hit_step_seconds", 0.0) for s in spec)
            hit_verify = sum(s.get("hit_step_verify_seconds", 0.0) for s in spec)
            out[mode]["hit_steps"] = sum(s.get("hit_steps", 0) for s in spec)
            hits = sum(out[mode]["branch_hits"])
            rounds = hits + sum(out[mode]["branch_misses"])
            out[mode]["hit_rate"] = hits / rounds if rounds else 0.0
            out[mode]["hit_step_over_verify"] = hit_step / hit_verify if hit_verify else None
            out[mode]["hit_round_seconds"] = [s.get("hit_round_seconds", 0.0) for s in spec]
            out[mode]["hit_verify_seconds"] = [s.get("hit_verify_seconds", 0.0) for s in spec]
    out["async_over_sync"] = out["sync"]["wall_s_median"] / out["async"]["wall_s_median"]
    out["async_over_ar"] = out["ar"]["wall_s_median"] / out["async"]["wall_s_median"]
    return out


def scenario_documents(url: str, repeats: int, tokens: int) -> dict:
    async def alone() -> float:
        async with httpx.AsyncClient() as client:
            return (await chat(client, url, SHORT, "auto", tokens))["seconds"]

    alone_s = statistics.median(asyncio.run(alone()) for _ in range(3))
    docs = documents(6 * repeats)
    runs = [
        asyncio.run(behind_documents(url, docs[6 * i : 6 * i + 6], tokens)) for i in range(repeats)
    ]
    behind = [r["short"]["seconds"] for r in runs]
    return {
        "short_alone_s": alone_s,
        "short_behind_s": behind,
        "short_slowdown": [b / alone_s for b in behind],
        "six_answers_s": [r["six_s"] for r in runs],
        "qa": [[{k: v for k, v in q.items() if k != "answer"} for q in r["qa"]] for r in runs],
        "short_speculative": [r["short"]["speculative"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.serve_pipeline", description=__doc__)
    p.add_argument("--out", default="eval/results/serve")
    p.add_argument("--port", type=int, default=8937)
    p.add_argument("--drafter", default="d3d/checkpoints/smollm2-135m-7layer")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="chat answer length (scenario 1)")
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--doc-repeats", type=int, default=2)
    p.add_argument("--skip", default="", help="comma list of scenarios to skip: modes,documents")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--threads", str(args.threads), "--drafter", args.drafter]
    with served(flags, args.port, out / "pipeline_server.log") as srv:
        url = srv.url
        doc: dict = {
            "command": "python -m eval.serve_pipeline "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "server": srv.args,
            "warmup": srv.ready.get("warmup"),
        }
        skip = set(args.skip.split(","))
        if "modes" not in skip:
            doc["four_chats"] = scenario_modes(url, args.repeats, args.tokens)
            print(json.dumps(doc["four_chats"], indent=1), flush=True)
        if "documents" not in skip:
            doc["behind_documents"] = scenario_documents(url, args.doc_repeats, args.short_tokens)
            print(json.dumps(doc["behind_documents"], indent=1), flush=True)
        (out / "pipeline.json").write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
