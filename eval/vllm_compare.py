"""The own engine, vLLM, vLLM with the D3D proposer and vLLM's ``ngram`` side by side.

One run starts each server in turn on loopback with the embedded SmolLM2-135M (fp32, both
cores) and measures it with :mod:`eval.serve_load`'s closed-loop streaming chat clients (greedy,
``--max-tokens`` new tokens) at each level of ``--levels`` on the project's short prompts, and at
``--long-clients`` concurrent on ~2k-token prompts (a messy essay and a question,
:func:`eval.longbench.messy.messy_document`):

- ``own``: ``d3d serve`` with its defaults (the own engine, ``auto``);
- ``vllm``: vLLM's OpenAI server, no speculation;
- ``ngram``: vLLM's OpenAI server with its ``ngram`` proposer (K = 15, n-grams of 2-4);
- ``d3d-sync``, ``d3d-async``, ``d3d-auto``: ``d3d serve --engine vllm`` (vLLM's engine, the
  D3D drafter as its proposer on the last core), each request asking for that mode.

Every answer is compared with the same prompt's answer on ``vllm`` (greedy vLLM without
drafts): the D3D modes must match it exactly; the own engine and ``ngram`` are reported. With
``--repeats R`` the pairs ``vllm`` / ``d3d-auto`` are measured R times alternately at each short
level (both servers up, one measured at a time) and the medians' ratio is reported: the check
that ``auto`` costs nothing where speculation does not pay. ``--split`` adds two arms to that
alternation, to say where a shortfall comes from: ``d3d-nodraft`` (``d3d serve --engine vllm
--drafter none``: the project's front on vLLM with no speculative configuration) and ``d3d-ar``
(the D3D server, requests in ``ar``: the speculative configuration, no drafts). Writes
``OUT/compare.json``, ``OUT/compare.md`` and ``OUT/compare.png``.

Usage: python -m eval.vllm_compare --out eval/results/vllm_compare
(it times: run it with nothing else busy on the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from eval.field_bench import VLLM_ENV
from eval.field_bench import vllm_server as field_vllm
from eval.longbench.messy import messy_document
from eval.serve_load import PROMPTS, one_request, percentile, served, wait_ready

CONFIGS = ("own", "vllm", "ngram", "d3d-sync", "d3d-async", "d3d-auto")
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 15,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def long_prompts(n: int, words: int = 1500) -> list[str]:
    """~2k-token prompts: a different messy essay each, and a question about it."""
    return [
        messy_document(words, seed=i) + "\n\nIn one sentence, what is the essay above about?"
        for i in range(n)
    ]


@contextlib.contextmanager
def vllm_server(port: int, log: Path, speculative: dict | None = None) -> Iterator[str]:
    """vLLM's own OpenAI server on the embedded model's folder (both cores;
    :func:`eval.field_bench.vllm_server`), up to 64 sequences at once."""
    from d3d.model.load import embedded_default_dir

    extra = ["--max-num-seqs", "64"]
    if speculative:
        extra += ["--speculative-config", json.dumps(speculative)]
    with field_vllm(port, embedded_default_dir(), log, extra=extra) as url:
        yield url


async def level(
    url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int, mode: str | None
) -> dict:
    """``clients`` closed-loop clients, ``per_client`` requests each over ``prompts``."""
    extra = {"speculative": {"mode": mode}} if mode else None
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:

        async def worker(c: int) -> list[dict]:
            return [
                await one_request(
                    client, url, prompts[(c * per_client + i) % len(prompts)], max_tokens, extra
                )
                for i in range(per_client)
            ]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*map(worker, range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200 and "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "clients": clients,
        "requests": len(results),
        "ok": len(ok),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50": percentile([r["ttft"] for r in ok], 0.5),
        "latency_p50": percentile([r["latency"] for r in ok], 0.5),
        "texts": {r["prompt"]: r.get("text") for r in ok},
    }


def per_client(clients: int, n_prompts: int) -> int:
    return n_prompts if clients == 1 else max(n_prompts, 2 * clients) // clients


def measure(
    url: str,
    levels: list[int],
    longs: list[str],
    long_clients: int,
    max_tokens: int,
    mode: str | None,
) -> dict:
    out = {}
    for c in levels:
        out[str(c)] = asyncio.run(
            level(url, PROMPTS, c, per_client(c, len(PROMPTS)), max_tokens, mode)
        )
        print(f"  {c:3d} clients: {out[str(c)]['tokens_per_s']:.1f} tok/s", flush=True)
    if long_clients:
        lv = asyncio.run(
            level(url, longs, long_clients, len(longs) // long_clients, max_tokens, mode)
        )
        out["long"] = lv
        print(
            f"  long x{long_clients}: {lv['tokens_per_s']:.1f} tok/s, TTFT p50 "
            f"{lv['ttft_p50']:.2f} s",
            flush=True,
        )
    return out


def identical(a: dict, ref: dict) -> tuple[int, int]:
    """(answers equal to the reference's, answers compared) over every level."""
    same = total = 0
    for key, lv in a.items():
        for prompt, text in lv["texts"].items():
            want = ref.get(key, {}).get("texts", {}).get(prompt)
            if want is not None:
                total += 1
                same += text == want
    return same, total


def alternate(urls: dict[str, str], levels: list[int], repeats: int, max_tokens: int) -> dict:
    """Each server of ``urls`` (``vllm``, ``d3d-auto`` and any others) measured alternately
    ``repeats`` times per level; ratios of medians against ``vllm``."""
    out: dict = {}
    for c in levels:
        runs: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(repeats):
            for name, url in urls.items():
                mode = {"d3d-auto": "auto", "d3d-ar": "ar"}.get(name)
                lv = asyncio.run(
                    level(url, PROMPTS, c, per_client(c, len(PROMPTS)), max_tokens, mode)
                )
                runs[name].append(lv["tokens_per_s"])
        med = {name: statistics.median(v) for name, v in runs.items()}
        ratios = {name: m / med["vllm"] for name, m in med.items() if name != "vllm"}
        out[str(c)] = {"runs": runs, "median": med, "ratio": ratios["d3d-auto"], "ratios": ratios}
        shown = ", ".join(f"{n} {r:.3f}" for n, r in ratios.items())
        print(f"  alternating at {c}, against vllm: {shown} {runs}", flush=True)
    return out


def report(out: Path, results: dict, meta: dict) -> None:
    ref = results.get("vllm", {})
    keys = [k for k in next(iter(results.values()))]
    head = (
        "| server | "
        + " | ".join(
            f"{k} clients tok/s" if k != "long" else "~2k-token prompts tok/s (TTFT p50)"
            for k in keys
        )
        + " | identical to vLLM |"
    )
    rows = [head, "|---" * (len(keys) + 2) + "|"]
    for name, res in results.items():
        cells = []
        for k in keys:
            lv = res[k]
            cell = f"{lv['tokens_per_s']:.1f}"
            if k == "long":
                cell += f" ({lv['ttft_p50']:.2f} s)"
            if name != "vllm" and k in ref:
                cell += f" ({lv['tokens_per_s'] / ref[k]['tokens_per_s']:.2f}x)"
            cells.append(cell)
        same, total = identical(res, ref)
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {same}/{total} |")
    alt = meta.get("alternating")
    text = f"Command: `{meta['command']}`\n\n" + "\n".join(rows) + "\n"
    if alt:
        names = list(next(iter(alt.values()))["median"])
        text += "\nAlternating repeats (medians, tok/s; x: against vllm):\n\n"
        text += "| clients | " + " | ".join(names) + " |\n|---:" + "|---:" * len(names) + "|\n"
        for c, a in alt.items():
            cells = [
                f"{a['median'][n]:.1f}" + (f" ({a['ratios'][n]:.3f}x)" if n != "vllm" else "")
                for n in names
            ]
            text += f"| {c} | " + " | ".join(cells) + " |\n"
    (out / "compare.md").write_text(text)
    slim = {
        n: {k: {kk: vv for kk, vv in lv.items() if kk != "texts"} for k, lv in r.items()}
        for n, r in results.items()
    }
    (out / "compare.json").write_text(json.dumps({"meta": meta, "results": slim}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(results)
    for i, (name, res) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [res[k]["tokens_per_s"] for k in keys], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{k} clients" if k != "long" else "~2k-token prompts" for k in keys])
    ax.set_ylabel("output tokens/s"), ax.legend(ncol=3, fontsize=8), ax.grid(axis="y", alpha=0.3)
    ax.set_title("SmolLM2-135M on this 2-core CPU: own engine, vLLM, vLLM + D3D, vLLM ngram")
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="eval/results/vllm_compare")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--levels", default="1,16,64")
    p.add_argument("--long-clients", type=int, default=4)
    p.add_argument("--long-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=0, help="alternate vllm / d3d-auto R times")
    p.add_argument("--alternate-levels", default="1,16")
    p.add_argument(
        "--split", action="store_true", help="alternate d3d-nodraft and d3d-ar too (see above)"
    )
    p.add_argument("--port", type=int, default=8951)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = args.configs.split(",")
    levels = [int(x) for x in args.levels.split(",")]
    longs = long_prompts(args.long_prompts)
    results: dict[str, dict] = {}
    meta: dict = {"command": "python -m eval.vllm_compare " + " ".join(argv or sys.argv[1:])}

    def run(name: str, url: str, mode: str | None = None) -> None:
        print(f"{name}:", flush=True)
        results[name] = measure(url, levels, longs, args.long_clients, args.max_tokens, mode)
        meta.setdefault("servers", {})[name] = url

    d3d_flags = ["--max-batch", "64", "--max-queue", "256"]
    if "own" in configs:
        with served(d3d_flags, args.port, out / "own.log") as srv:
            run("own", srv.url)
    if "vllm" in configs:
        with vllm_server(args.port + 1, out / "vllm.log") as url:
            run("vllm", url)
    if "ngram" in configs:
        with vllm_server(args.port + 2, out / "ngram.log", NGRAM) as url:
            run("ngram", url)
    # auto first: the modes share one server, whose vLLM keeps the prompts it read (prefix
    # cache), so the first mode is the only one that reads the ~2k-token prompts cold.
    d3d_modes = sorted((c for c in configs if c.startswith("d3d-")), key=lambda c: c != "d3d-auto")
    if d3d_modes or args.repeats:
        os.environ.update(VLLM_ENV)
        with served([*d3d_flags, "--engine", "vllm"], args.port + 3, out / "d3d-vllm.log") as srv:
            for name in d3d_modes:
                run(name, srv.url, name.removeprefix("d3d-"))
            if args.repeats:
                with contextlib.ExitStack() as more:
                    plain = more.enter_context(vllm_server(args.port + 4, out / "vllm-alt.log"))
                    urls = {"vllm": plain}
                    if args.split:
                        nodraft = more.enter_context(
                            served(
                                [*d3d_flags, "--engine", "vllm", "--drafter", "none"],
                                args.port + 5,
                                out / "d3d-nodraft.log",
                            )
                        )
                        urls |= {"d3d-nodraft": nodraft.url, "d3d-ar": srv.url}
                        wait_ready(nodraft.url)
                    urls["d3d-auto"] = srv.url
                    wait_ready(srv.url)
                    alt = [int(x) for x in args.alternate_levels.split(",")]
                    meta["alternating"] = alternate(urls, alt, args.repeats, args.max_tokens)
    report(out, results, meta)
    print((out / "compare.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
