"""Soak test: N streaming chat clients for M minutes against a ``d3d serve`` it starts; memory,
KV, latency and errors over time, and the pass criteria of issue 31 ("a service that heals
itself").

Design:

- One way to start a service and one client: the server comes from
  :func:`eval.serve_load.served` (``--server-args`` passed through to ``d3d serve``), and every
  request is :func:`eval.serve_load.one_request` (a streaming greedy chat completion over the
  load test's prompts). Each client sends one request after another until the end time; a
  request in flight then finishes and counts.
- Every ``--sample-every`` seconds (10) a sampler reads the RSS of the server process and of all
  its descendants (psutil: a drafter worker runs as a child process) and the KV in use
  (``d3d_kv_tokens_in_use``) and running requests from ``/metrics``, and prints a progress line.
- Requests are kept by finish time; per minute: requests, errors, generated tokens/s and latency
  p50 / p90 / p99. ``OUT/soak.json`` is rewritten (atomically) at every minute and at the end,
  so a run cut short keeps what it measured; the plot (RSS and p99 over time) goes to
  ``--plot`` (``docs/soak.png``).
- Criteria (:func:`criteria`, pure): no error; after the warm-up (5 minutes) the server's RSS
  never exceeds its value at the end of the warm-up by 5% or more; the p99 latency of the last
  5 minutes is at most 10% above that of minutes 5-10 (faster is a pass). A run shorter than 15
  minutes has no room for those windows: all three scale by M / 30, and the report says so.

Usage: python -m eval.soak [--clients 16] [--minutes 30] [--out eval/results/soak]
  [--server-args "--threads 2"] (it times: run it with nothing else busy on the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from eval.serve_load import PROMPTS, one_request, percentile, served

FULL_MINUTES = 30.0  # the soak; its windows: warm-up 5, reference 5-10, last 5
SCALE_BELOW = 15.0  # shorter runs scale the windows by minutes / FULL_MINUTES
MEMORY_GROWTH = 0.05
P99_GROWTH = 0.10


@dataclass(frozen=True)
class Windows:
    """The criteria's windows in seconds from the start: warm-up [0, warm), reference
    [warm, ref_end), last [last_start, end); ``scaled``: shrunk for a short run."""

    warm: float
    ref_end: float
    last_start: float
    end: float
    scaled: bool


def windows(minutes: float) -> Windows:
    f = minutes / FULL_MINUTES if minutes < SCALE_BELOW else 1.0
    end = minutes * 60
    return Windows(300 * f, 600 * f, end - 300 * f, end, f < 1.0)


def criteria(requests: list[list], samples: list[dict], w: Windows) -> dict:
    """The pass criteria over ``requests`` ([t_finish, status, latency_s, ttft_s, tokens]) and
    ``samples`` (``t``, ``rss``) of a run with windows ``w`` (see the module docstring)."""
    errors = sum(1 for r in requests if r[1] != 200)
    after = [s for s in samples if s["t"] >= w.warm]
    base = after[0]["rss"] if after else None
    peak = max((s["rss"] for s in after), default=None)
    growth = peak / base - 1 if base else None
    ok = [r for r in requests if r[1] == 200]
    ref = percentile([r[2] for r in ok if w.warm <= r[0] < w.ref_end], 0.99)
    last = percentile([r[2] for r in ok if r[0] >= w.last_start], 0.99)
    ratio = last / ref if ref and not math.isnan(ref) and not math.isnan(last) else None
    memory_ok = growth is not None and growth < MEMORY_GROWTH
    p99_ok = ratio is not None and ratio <= 1 + P99_GROWTH
    return {
        "passed": errors == 0 and memory_ok and p99_ok,
        "windows": asdict(w),
        "errors": errors,
        "errors_ok": errors == 0,
        "rss_after_warmup": base,
        "rss_peak_after": peak,
        "memory_growth": growth,
        "memory_ok": memory_ok,
        "p99_reference_s": ref,
        "p99_last_s": last,
        "p99_ratio": ratio,
        "p99_ok": p99_ok,
    }


def per_minute(requests: list[list], samples: list[dict], end: float) -> list[dict]:
    """Requests by finish minute: count, errors, tokens/s, latency percentiles; peak RSS and KV."""
    n = max(1, math.ceil(end / 60))

    def minute(t: float) -> int:  # the last minute also takes what finished after the end
        return min(int(t // 60), n - 1)

    out = []
    for m in range(n):
        rs = [r for r in requests if minute(r[0]) == m]
        ss = [s for s in samples if minute(s["t"]) == m]
        lat = [r[2] for r in rs if r[1] == 200]
        kv = [s["kv"] for s in ss if s.get("kv") is not None]
        out.append(
            {
                "minute": m + 1,
                "requests": len(rs),
                "errors": sum(1 for r in rs if r[1] != 200),
                "tokens_per_s": sum(r[4] for r in rs) / max(min(end, 60 * (m + 1)) - 60 * m, 1e-9),
                "p50_s": percentile(lat, 0.5),
                "p90_s": percentile(lat, 0.9),
                "p99_s": percentile(lat, 0.99),
                "rss_mib": max((s["rss"] for s in ss), default=0) / 2**20,
                "kv_max": max(kv) if kv else None,
            }
        )
    return out


def process_rss(pid: int) -> dict[str, int]:
    """RSS in bytes of the process ``pid`` and each of its descendants (a drafter worker
    among them), by ``pid`` and the start of its command line."""
    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            out[f"{p.pid} {' '.join(p.cmdline()[:4])[:80]}"] = p.memory_info().rss
    return out


async def gauges(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(url + "/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}  # fmt: skip


class Soak:
    """One run: clients, the sampler, and the report written as it goes."""

    def __init__(self, url: str, pid: int, args: argparse.Namespace, meta: dict):
        self.url, self.pid, self.args, self.meta = url, pid, args, meta
        self.requests: list[list] = []  # [t_finish, status, latency, ttft, tokens]
        self.errors: list[dict] = []
        self.samples: list[dict] = []
        self.t0 = 0.0
        self.written_minute = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def client(self, http: httpx.AsyncClient, c: int) -> None:
        i = c
        while self.now() < self.args.minutes * 60:
            r = await one_request(http, self.url, PROMPTS[i % len(PROMPTS)], self.args.max_tokens)
            t = self.now()
            status = r["status"]  # -1: no answer (a failed connection, a stream cut short)
            if "error" in r and status == 200:  # an error event inside the stream
                status = -1
            lat, ttft = round(r.get("latency", 0.0), 4), round(r.get("ttft", 0.0), 4)
            self.requests.append([round(t, 3), status, lat, ttft, r.get("tokens", 0)])
            if status != 200:
                self.errors.append({"t": round(t, 1), "status": status, "error": r.get("error")})
            i += self.args.clients

    async def sampler(self, http: httpx.AsyncClient) -> None:
        while True:
            rss = process_rss(self.pid)
            try:
                m = await gauges(http, self.url)
            except httpx.HTTPError as exc:
                m = {"error": repr(exc)}
            t = self.now()
            kv, running = m.get("d3d_kv_tokens_in_use"), m.get("d3d_running_requests")
            self.samples.append(
                {"t": round(t, 1), "rss": sum(rss.values()), "processes": rss, "kv": kv,
                 "running": running, "metrics_error": m.get("error")}
            )  # fmt: skip
            self.progress(t)
            if int(t // 60) > self.written_minute:
                self.written_minute = int(t // 60)
                self.write()
            await asyncio.sleep(self.args.sample_every)

    def progress(self, t: float) -> None:
        recent = [r[2] for r in self.requests if r[0] >= t - 60 and r[1] == 200]
        tokens = sum(r[4] for r in self.requests if r[0] >= t - 60)
        s = self.samples[-1]
        print(f"[{t / 60:5.1f}/{self.args.minutes:g} min] {len(self.requests)} requests, "
              f"{len(self.errors)} errors, {tokens / min(max(t, 1), 60):.1f} tok/s, "
              f"p99 {percentile(recent, 0.99):.2f} s (last minute), RSS {s['rss'] / 2**20:.0f} MiB "
              f"in {len(s['processes'])} process(es), KV {s['kv']}", flush=True)  # fmt: skip

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.args.clients + 4)
        async with httpx.AsyncClient(timeout=900, limits=limits) as http:
            self.t0 = time.perf_counter()
            sampler = asyncio.create_task(self.sampler(http))
            try:
                await asyncio.gather(*(self.client(http, c) for c in range(self.args.clients)))
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler

    def report(self) -> dict:
        end = max(self.now(), 1e-9)
        w = windows(min(self.args.minutes, end / 60))
        return {
            "meta": {**self.meta, "seconds": round(end, 1)},
            "criteria": criteria(self.requests, self.samples, w),
            "minutes": per_minute(self.requests, self.samples, end),
            "samples": self.samples,
            "errors": self.errors,
            "requests": self.requests,
        }

    def write(self) -> dict:
        rep = self.report()
        out = Path(self.args.out) / "soak.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rep, indent=1))
        os.replace(tmp, out)
        return rep


def table(rep: dict) -> str:
    rows = ["| minute | requests | errors | tok/s | p50 s | p90 s | p99 s | RSS MiB | KV max |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for m in rep["minutes"]:
        rows.append(f"| {m['minute']} | {m['requests']} | {m['errors']} | {m['tokens_per_s']:.1f} "
                    f"| {m['p50_s']:.2f} | {m['p90_s']:.2f} | {m['p99_s']:.2f} | {m['rss_mib']:.0f} "
                    f"| {m['kv_max']} |")  # fmt: skip
    c, w = rep["criteria"], rep["criteria"]["windows"]
    mem = "n/a" if c["memory_growth"] is None else f"{100 * c['memory_growth']:+.1f}%"
    ratio = "n/a" if c["p99_ratio"] is None else f"{c['p99_ratio']:.2f}x"
    rows += [
        "",
        f"windows: warm-up {w['warm']:.0f} s, reference {w['warm']:.0f}-{w['ref_end']:.0f} s, last "
        f"{w['last_start']:.0f}-{w['end']:.0f} s"
        + (" (scaled by minutes/30: a run under 15 minutes)" if w["scaled"] else ""),
        f"errors: {c['errors']} -> {'PASS' if c['errors_ok'] else 'FAIL'}",
        f"memory growth after warm-up (peak vs its end): {mem} (< 5%) -> "
        f"{'PASS' if c['memory_ok'] else 'FAIL'}",
        f"p99 last window vs reference: {ratio} (<= 1.10x) -> {'PASS' if c['p99_ok'] else 'FAIL'}",
        f"soak: {'PASS' if c['passed'] else 'FAIL'}",
    ]
    return "\n".join(rows)


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, m, w = rep["samples"], rep["minutes"], rep["criteria"]["windows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot([x["t"] / 60 for x in s], [x["rss"] / 2**20 for x in s], ".-", label="server RSS")
    a.set_xlabel("minutes"), a.set_ylabel("MiB (server and its children)"), a.grid(alpha=0.3)
    b.plot([x["minute"] - 0.5 for x in m], [x["p99_s"] for x in m], "s-", label="p99")
    b.plot([x["minute"] - 0.5 for x in m], [x["p50_s"] for x in m], "o-", label="p50")
    b.set_xlabel("minutes"), b.set_ylabel("latency s"), b.grid(alpha=0.3), b.legend()
    for ax in (a, b):
        ax.axvspan(w["warm"] / 60, w["ref_end"] / 60, color="grey", alpha=0.15)
        ax.axvspan(w["last_start"] / 60, w["end"] / 60, color="tab:orange", alpha=0.15)
    meta = rep["meta"]
    fig.suptitle(f"d3d serve soak: {meta['clients']} streaming clients, {meta['seconds'] / 60:.1f} "
                 "min (shaded: reference and last windows)")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--out", default="eval/results/soak", help="folder for soak.json, server.log")
    p.add_argument("--plot", default="docs/soak.png")
    p.add_argument("--server-args", default="", help='passed to d3d serve, e.g. "--threads 2"')
    p.add_argument("--port", type=int, default=8933)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    args = p.parse_args(argv)
    if args.clients < 1 or args.minutes <= 0 or args.sample_every <= 0:
        p.error("--clients, --minutes and --sample-every must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = shlex.split(args.server_args)
    with served(flags, args.port, out / "server.log") as srv:
        command = shlex.join(argv if argv is not None else sys.argv[1:])
        meta = {
            "command": f"python -m eval.soak {command}",
            "clients": args.clients,
            "minutes": args.minutes,
            "max_tokens": args.max_tokens,
            "server_args": srv.args,
            "server": {
                k: srv.ready.get(k) for k in ("model", "target_device", "drafter", "max_kv_tokens")
            },
        }
        soak = Soak(srv.url, srv.pid, args, meta)
        try:
            asyncio.run(soak.run())
        finally:  # also when cut short (Ctrl-C): keep what was measured
            rep = soak.write()
    plot(rep, Path(args.plot))
    print(table(rep))
    print(f"wrote {out / 'soak.json'} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
