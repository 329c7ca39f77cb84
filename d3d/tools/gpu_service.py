"""The GPU check's service run: the engine serving concurrent requests, one decoding mode at a time.

:func:`run_service` puts an already built target (random weights are fine: only shapes and
kernels are measured) behind the library's :class:`~d3d.engine.Engine`, with its drafter built
the engine's own way (:func:`~d3d.engine.build_drafter`: ``self:5``, the target's first five
layers sharing their tensors; or ``replay:7.88``, the replay instrument the GPU check runs, whose
``ar`` stage records the outputs the other modes replay), and sends ``requests`` concurrent
requests through the engine's one scheduler, stepping it until it is idle (the KV budget admits
every row at once). Each mode (``ar``, ``sync``, ``async``, ``auto``) gets the same prompts
(:func:`~d3d.tools.service_modes.run_mode` runs one mode and records what it did):

- aggregate throughput (generated tokens over the stage's wall time, prompts included) and the
  decode-only rate (tokens over the steps that read no prompt), each as a ratio to ``ar``'s
  (``speedup_vs_ar``, end to end; ``decode_speedup_vs_ar``, the decoding the paper's speed-ups
  measure);
- steps, and per decode step its time and its verify forward's time (the scheduler's
  ``last_verify_s``), with the forward's width, and the engine thread's host-device waits in it
  (:mod:`d3d.tools.syncs`; not the clock's around it; the worker's as totals);
- the requests' speculation figures (vLLM names: drafts, draft tokens, accepted tokens,
  acceptance length; the asynchronous pipeline's hits, misses and worker failures);
- whether each request's tokens equal its ``ar`` tokens (greedy is lossless; in bf16 on a GPU a
  forward of another width may flip a near tie, so there it is reported, not asserted);
- the peak memory per device (``torch.cuda.max_memory_allocated``; None on a CPU), beside
  what ``d3d plan`` predicts for the same shapes (:mod:`d3d.tools.plan`).

Each mode is run once over the same requests before it is measured, so the measured run meets
no step shape it has not met (on the cuda backend a new shape is a graph warmed up and captured
inside the measured time, and the decode stage's context differs from the service's); the
measured run says how many it met anyway (``new_shapes``: 0 is a steady-state figure).
EOS is switched off by the caller's config, so every request runs to its budget and the token
counts of the modes are equal. Timings come from the engine's own clock, which synchronises the
devices (:class:`~d3d.backends.clock.Clock`). A stage that passes its time limit cancels its
requests and is reported with ``timed_out`` and what it did until then; a stage that fails is
reported with its error, and the next stage still runs.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from d3d.backends import Backend
from d3d.backends.cuda.kv import MIN_CAPACITY
from d3d.config import DEFAULT_BLOCK_SIZE, MODES, ModelConfig
from d3d.engine import Engine, PrefillBudget, build_drafter, check_device
from d3d.model.load import LoadedModel
from d3d.tools.plan import PlanSettings, make_plan
from d3d.tools.service_modes import run_mode
from d3d.worker import ServerConfig


class ServiceError(ValueError):
    """The service run's settings cannot work; the message names the field."""


@dataclass(frozen=True)
class ServiceSettings:
    """One service run: ``requests`` prompts of ``prompt_tokens`` random ids, ``new_tokens``
    each, decoded in each of ``modes`` (a stage of at most ``stage_seconds``)."""

    requests: int = 16
    prompt_tokens: int = 512
    new_tokens: int = 128
    modes: tuple[str, ...] = ("ar", "sync", "async")
    drafter: str = "self:5"
    drafter_device: str | None = None  # None: the target's device
    stage_seconds: float = 90.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "prompt_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ServiceError(f"{name}: must be >= 1, got {getattr(self, name)}")
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad:
            raise ServiceError(f"modes: each must be one of {', '.join(MODES)}, got {bad or '()'}")
        if self.stage_seconds <= 0:
            raise ServiceError(f"stage_seconds: must be > 0, got {self.stage_seconds}")

    @property
    def needs_drafter(self) -> bool:
        return any(m != "ar" for m in self.modes)


def build_engine(model, name: str, s: ServiceSettings, backend: Backend | None = None) -> Engine:
    """The engine over ``model`` with ``s.drafter`` built its own way (a ``replay:`` spec: the
    replay instrument, :mod:`d3d.replay`, whose ``ar`` stage records what the others replay), on
    the backend the model's device gets; a KV budget that admits every row at once and no
    prefix cache. ``backend``: how the target runs (default: chosen by its device)."""
    target = LoadedModel(model, None, name)
    device = str(target.device)
    drafter_device = s.drafter_device or device
    check_device(drafter_device)
    if backend is not None:  # as Engine.from_config: before a drafter shares the layers
        backend.prepare(model)
    drafter = (
        build_drafter(s.drafter, target, drafter_device, share_layers=True)
        if s.needs_drafter
        else None
    )
    if backend is not None and drafter is not None:  # the worker drafts through it (packed)
        backend.prepare_drafter(drafter.lm)
    block = drafter.block_size if drafter is not None else DEFAULT_BLOCK_SIZE
    cfg = ModelConfig(
        target=name,
        drafter=s.drafter,
        target_device=device,
        drafter_device=drafter_device,  # a thread worker beside the target, on this device
        pack=False,
        # every row admitted at once: a reservation each (on the cuda backend, a slot each)
        max_kv_tokens=s.requests * max(s.prompt_tokens + s.new_tokens + block, MIN_CAPACITY),
        prefix_cache="0",
    )
    engine = Engine(target, drafter, cfg, backend)
    engine.scheduler(max_batch=s.requests)  # built now: max_batch only counts on first use
    return engine


def predict_memory(name: str, config: dict, s: ServiceSettings, engine: Engine) -> dict:
    """``d3d plan``'s bytes per device for the run's shapes: batch = requests, a sequence's KV =
    one reservation, prefill chunks of the scheduler's largest, the worker's most branches."""
    device = str(engine.target.device)
    dtype = str(engine.target.model.dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.json"
        path.write_text(json.dumps(config))
        settings = PlanSettings(
            target=str(path),
            drafter=s.drafter,
            dtype=dtype,
            batch=s.requests,
            max_kv_tokens=s.prompt_tokens + s.new_tokens + engine.block_size,
            prefill_chunk=PrefillBudget().max_chunk,
            branches=ServerConfig().max_branches,
            block_size=engine.block_size,
            rows=1,  # the worker drafts each row's branches in a forward of their own
            device=device,
            drafter_device=s.drafter_device or device,
        )
        plan = make_plan(settings)
    return {
        "settings": asdict(settings) | {"target": path.name},
        "devices": plan.to_dict()["devices"],
    }


def run_service(
    model, name: str, config: dict, s: ServiceSettings, time_left, backend: Backend | None = None
) -> dict:
    """Build the engine over ``model`` (``name``, whose config is ``config``: a dict as in
    ``d3d/configs/``), warm each mode up with one short request, then run each mode's stage.
    ``time_left()``: seconds this run may still take (each stage gets the lesser of that, minus
    a margin, and ``s.stage_seconds``)."""
    engine = build_engine(model, name, s, backend)
    out: dict = {
        "settings": asdict(s) | {"max_kv_tokens": engine.model_cfg.max_kv_tokens},
        "devices": {
            "target": str(engine.target.device),
            "drafter": str(engine.drafter.device) if engine.drafter is not None else None,
        },
        "modes": {},
    }
    out["captured_up_front"], capture_s = engine.capture()  # as the service's warm-up does
    out["capture_s"] = round(capture_s, 3)
    try:
        out["memory_plan"] = predict_memory(name, config, s, engine)
    except Exception as exc:  # a plan that cannot be made must not cost the measurement
        out["memory_plan"] = {"error": f"{type(exc).__name__}: {exc}"}
    gen = torch.Generator().manual_seed(s.seed)
    vocab = engine.target.vocab_size
    prompts = [
        torch.randint(0, vocab, (s.prompt_tokens,), generator=gen).tolist()
        for _ in range(s.requests)
    ]
    try:
        t0 = engine.clock.now()
        warm = out["warmup"] = {}
        for mode in s.modes:  # the measured run's shapes, the worker's start: not measured
            left = min(s.stage_seconds, max(time_left() - 5, 1))
            run = run_mode(engine, mode, prompts, s.new_tokens, left)
            warm[mode] = {"wall_s": round(run.wall_s, 3), "new_shapes": run.new_shapes,
                          "drafter_new_shapes": run.drafter_new_shapes}  # fmt: skip
        out["warmup_s"] = round(engine.clock.now() - t0, 3)
        reference: list[list[int]] | None = None
        for mode in s.modes:
            left = time_left() - 5  # a margin for the summary and the JSON
            if left <= 1:
                out["modes"][mode] = {"mode": mode, "skipped": "out of time"}
                continue
            try:
                run = run_mode(engine, mode, prompts, s.new_tokens, min(s.stage_seconds, left))
            except Exception as exc:  # the next mode still runs
                out["modes"][mode] = {"mode": mode, "errors": [f"{type(exc).__name__}: {exc}"]}
                continue
            res = out["modes"][mode] = run.summary()
            if mode == "ar" and not run.timed_out:
                reference = run.outputs
            elif reference is not None and not run.timed_out:
                res["matches_ar"] = sum(a == b for a, b in zip(run.outputs, reference, strict=True))
    finally:
        engine.close()
    _compare(out)
    return out


def _compare(out: dict) -> None:
    """Each mode's throughput over ``ar``'s (end to end, and decoding alone), and the measured
    peak beside the plan's."""
    modes = out["modes"]
    for key, ratio in (("tok_s", "speedup_vs_ar"), ("decode_tok_s", "decode_speedup_vs_ar")):
        ar = modes.get("ar", {}).get(key)
        for res in modes.values():
            if ar and res.get(key):
                res[ratio] = round(res[key] / ar, 3)
    peaks: dict[str, int] = {}
    for res in modes.values():
        for dev, b in (res.get("peak_memory_bytes") or {}).items():
            peaks[dev] = max(peaks.get(dev, 0), b)
    predicted = {dev: d["peak_bytes"] for dev, d in out["memory_plan"].get("devices", {}).items()}
    out["memory"] = {
        "measured_peak_bytes": peaks or None,
        "predicted_peak_bytes": predicted or None,
        "measured_over_predicted": {
            dev: round(peaks[dev] / predicted[dev], 3) for dev in peaks if predicted.get(dev)
        }
        or None,
    }


def service_errors(out: dict) -> list[str]:
    """Every mode's errors (requests that failed, a stage that raised, drafts the worker failed:
    a request then goes on with the target alone, lossless but not what was meant to be
    measured), named by mode."""
    errors = []
    for mode, r in out.get("modes", {}).items():
        errors += [f"{mode}: {e}" for e in r.get("errors", [])]
        if r.get("worker_failures"):
            errors.append(f"{mode}: the drafter worker failed {r['worker_failures']} time(s)")
    return errors


def service_table(out: dict) -> list[str]:
    """The service run as a few lines of a Markdown table, for the terminal."""
    if not out.get("modes"):
        return []
    lines = [
        "",
        "| mode | tok/s | decode tok/s | vs ar (decode) | steps | new shapes | verify ms | accept "
        "| matches ar | timed out |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, r in out["modes"].items():
        verify = (r.get("verify_ms") or {}).get("median")
        lines.append(
            f"| {mode} | {r.get('tok_s')} | {r.get('decode_tok_s')} | {r.get('speedup_vs_ar')} "
            f"({r.get('decode_speedup_vs_ar')}) | {r.get('steps')} | {r.get('new_shapes')} | "
            f"{verify} | {r.get('acceptance_length')} | {r.get('matches_ar', '-')} | "
            f"{r.get('timed_out', r.get('skipped'))} |"
        )
    gib = 2**30
    mem = out.get("memory") or {}
    for dev, predicted in (mem.get("predicted_peak_bytes") or {}).items():
        measured = (mem.get("measured_peak_bytes") or {}).get(dev)
        shown = f"{measured / gib:.2f} GiB" if measured is not None else "not measured (no CUDA)"
        lines.append(f"peak memory {dev}: {shown}; d3d plan {predicted / gib:.2f} GiB")
    return lines
