"""One decoding mode's run through the engine's scheduler, and what it did (the GPU check's
service run, :mod:`d3d.tools.gpu_service`, runs one a mode, twice: once unmeasured).

:func:`run_mode` sends every prompt as a request of one mode at once and steps the scheduler
until it is idle, recording per step its time, its verify forward's time (the scheduler's
``last_verify_s``; None for a step that read a prompt), the tokens it emitted, the rows running
and the engine thread's host-device waits in it (:mod:`d3d.tools.syncs`; the other threads' as
totals), and how many step shapes the target met for the first time (``new_shapes``: on the
cuda backend each is a graph warmed up and captured inside the run). :meth:`ModeRun.summary` is
the JSON: throughput end to end and of the decode steps alone, step and verify times as
spreads, the requests' speculation figures in vLLM's names, the peak memory per device.
"""

from __future__ import annotations

import gc
import statistics
import threading
from dataclasses import dataclass, field

import torch

from d3d.backends.clock import Clock
from d3d.decoding.stats import DecodeStats
from d3d.engine import Engine, GenRequest
from d3d.tools.syncs import SyncCounter


def _peaks(engine: Engine) -> dict[str, int] | None:
    devs = engine.clock.cuda
    return {str(d): int(torch.cuda.max_memory_allocated(d)) for d in devs} if devs else None


def _reset_peaks(engine: Engine) -> None:
    gc.collect()
    for d in engine.clock.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d)


def spread(values: list[float], digits: int = 3) -> dict | None:
    """Median, 90th percentile, min and max of ``values`` (None when empty)."""
    if not values:
        return None
    v = sorted(values)
    p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
    return {
        k: round(x, digits)
        for k, x in (("median", statistics.median(v)), ("p90", p90), ("min", v[0]), ("max", v[-1]))
    }


@dataclass
class _Request:
    """One request's tokens and end, as the engine's callbacks report them."""

    clock: Clock
    tokens: list[int] = field(default_factory=list)
    first_at: float | None = None
    stats: DecodeStats | None = None
    error: BaseException | None = None

    def on_tokens(self, tokens: list[int]) -> None:
        if self.first_at is None:
            self.first_at = self.clock.now()
        self.tokens += tokens

    def on_finish(self, stats: DecodeStats, error: BaseException | None) -> None:
        self.stats, self.error = stats, error


@dataclass(frozen=True)
class _Step:
    seconds: float
    verify_s: float | None  # the scheduler's last_verify_s: None when the step read a prompt
    tokens: int  # emitted by the step
    rows: int  # running when it began
    syncs: int = 0  # host-device waits the engine's thread made in it (d3d.tools.syncs)


@dataclass
class ModeRun:
    """What one mode's stage did: its steps and its requests (:meth:`summary` for the JSON)."""

    mode: str
    requests: list[_Request]
    steps: list[_Step]
    wall_s: float
    t0: float
    timed_out: bool
    peaks: dict[str, int] | None
    other_syncs: dict[str, int] = field(default_factory=dict)  # other threads' (the worker's)
    new_shapes: int | None = None  # step shapes the target met for the first time (no runner: None)
    drafter_new_shapes: int | None = None  # the worker's packed forwards' (None: not known here)

    @property
    def outputs(self) -> list[list[int]]:
        return [r.tokens for r in self.requests]

    def summary(self) -> dict:
        stats = [r.stats for r in self.requests if r.stats is not None]
        errors = sorted({f"{type(r.error).__name__}: {r.error}" for r in self.requests if r.error})
        tokens = sum(len(r.tokens) for r in self.requests)
        decode = [s for s in self.steps if s.verify_s is not None]
        decode_s = sum(s.seconds for s in decode)
        drafts = sum(st.num_drafts for st in stats)
        accepted = sum(st.num_accepted_tokens for st in stats)
        reasons: dict[str, int] = {}
        for st in stats:
            reasons[st.stop_reason] = reasons.get(st.stop_reason, 0) + 1
        return {
            "mode": self.mode,
            "requests": len(self.requests),
            "finished": sum(st.stop_reason in ("length", "eos") for st in stats),
            "timed_out": self.timed_out,
            "errors": errors,
            "stop_reasons": reasons,
            "wall_s": round(self.wall_s, 3),
            "tokens": tokens,
            "tok_s": round(tokens / self.wall_s, 2) if self.wall_s > 0 else None,
            "decode_tok_s": round(sum(s.tokens for s in decode) / decode_s, 2)
            if decode_s
            else None,
            "steps": len(self.steps),
            "new_shapes": self.new_shapes,
            "drafter_new_shapes": self.drafter_new_shapes,
            "decode_steps": len(decode),
            "prefill_steps": len(self.steps) - len(decode),
            "step_ms": spread([s.seconds * 1e3 for s in decode]),
            "syncs_per_decode_step": spread([float(s.syncs) for s in decode], 1),
            "other_threads_syncs": self.other_syncs,
            "verify_ms": spread([s.verify_s * 1e3 for s in decode if s.verify_s is not None]),
            "rows_per_decode_step": spread([float(s.rows) for s in decode], 1),
            "ttft_s": spread([r.first_at - self.t0 for r in self.requests if r.first_at]),
            "num_drafts": drafts,
            "num_draft_tokens": sum(st.num_draft_tokens for st in stats),
            "num_accepted_tokens": accepted,
            "acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "draft_wait_s": round(sum(st.draft_seconds for st in stats), 3),
            "branch_hits": sum(st.branch_hits for st in stats),
            "branch_misses": sum(st.branch_misses for st in stats),
            "worker_failures": sum(st.worker_failures for st in stats),
            "peak_memory_bytes": self.peaks,
        }


def run_mode(
    engine: Engine, mode: str, prompts: list[list[int]], new_tokens: int, limit_s: float
) -> ModeRun:
    """Every prompt as one request of ``mode``, all at once through the engine's scheduler,
    stepped until idle (cancelled once ``limit_s`` has passed)."""
    sched, clock = engine.scheduler(), engine.clock
    requests = [_Request(clock) for _ in prompts]
    reqs = [
        GenRequest(list(p), new_tokens, mode=mode, on_tokens=r.on_tokens, on_finish=r.on_finish)
        for p, r in zip(prompts, requests, strict=True)
    ]
    runner = getattr(sched.target, "runner", None)  # the cuda backend's graphs (or eager steps)
    shapes = runner.shapes if runner is not None else None
    drafts = mode != "ar"  # (asking for the worker starts it)
    drafted = _worker_shapes(engine) if drafts else None
    _reset_peaks(engine)
    t0 = clock.now()
    for req in reqs:
        sched.add(req)
    steps: list[_Step] = []
    timed_out = False
    with SyncCounter() as syncs:
        while not sched.idle:
            if not timed_out and clock.now() - t0 > limit_s:
                timed_out = True
                for req in reqs:
                    req.cancel()  # dropped at the next step
            before = sum(len(r.tokens) for r in requests)
            rows, a = len(sched.rows), clock.now()
            syncs.take()  # the clock's own wait is not the step's
            sched.step()
            n = syncs.take()
            after = sum(len(r.tokens) for r in requests)
            steps.append(_Step(clock.now() - a, sched.last_verify_s, after - before, rows, n))
    wall = clock.now() - t0
    me = threading.current_thread().name  # its leftovers are the clock's waits
    others = {k: v for k, v in syncs.by_thread.items() if k != me}
    new = runner.shapes - shapes if runner is not None else None
    after = _worker_shapes(engine) if drafts else None
    drafter_new = after - (drafted or 0) if after is not None else None
    return ModeRun(mode, requests, steps, wall, t0, timed_out, _peaks(engine), others, new,
                   drafter_new)  # fmt: skip


def _worker_shapes(engine: Engine) -> int | None:
    """The step shapes the drafter worker's forwards have met, where it runs in a thread of
    this process and drafts packed (None otherwise: a worker process's server is not here)."""
    sup = engine.drafters.worker(wait=False) if engine.drafter is not None else None
    server = getattr(sup.worker if sup is not None else None, "server", None)
    return getattr(server, "shapes", None)
