"""The host's measured decoding costs, kept between processes.

``auto`` decides from figures it measures (:class:`d3d.decoding.policy.HostCosts`): the plain
step, the verify's cost per token, the drafter's wait and acceptance, copy rounds per match
length, probe pacing. A long-lived engine (the service) learns them once. A one-shot command
(``d3d generate``, ``d3d qa``) would pay the first measurements in every process: the drafter's
first speculative rounds and each copy-match length's trial rounds, a large share of a short
answer's time on this CPU (measured: docs/results.md, "Figures from the code's docstrings"). So a
command's engine loads what the previous process on this host measured and leaves its own
figures when the process ends: one JSON file per host, models, devices, dtype, thread count and
packing (:func:`costs_path`). Probes keep refreshing the figures, so a stale file costs no more
than a fresh start; a missing, damaged or foreign file is a fresh start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from d3d.config import ModelConfig
from d3d.decoding.costs import Ema, PositionStats
from d3d.decoding.lookup import CopyCosts
from d3d.decoding.policy import HostCosts

log = logging.getLogger(__name__)

VERSION = 2  # 2: copy rounds keep acceptance per position


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def costs_path(cfg: ModelConfig, root: str | Path) -> Path:
    """The file for this configuration on this host, under ``root``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = json.dumps(
        {
            "model": asdict(cfg) | {"costs_dir": None},
            "cpu": _cpu(),
            "cores": cores,
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        sort_keys=True,
    )
    return Path(root) / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _ema(d: dict) -> Ema:
    return Ema(float(d["alpha"]), None if d["value"] is None else float(d["value"]))


def _positions(d: dict) -> PositionStats:
    return PositionStats(
        float(d["decay"]), [float(x) for x in d["reached"]], [float(x) for x in d["accepted"]]
    )


def from_dict(d: dict) -> HostCosts:
    """A :class:`HostCosts` from :func:`to_dict`'s output (KeyError/TypeError/ValueError if not)."""
    c = d["copy"]
    return HostCosts(
        step_s=_ema(d["step_s"]),
        per_token_s=_ema(d["per_token_s"]),
        wait_s=_ema(d["wait_s"]),
        accept=_positions(d["accept"]),
        probe_interval=int(d["probe_interval"]),
        since_probe=int(d["since_probe"]),
        wait_from_cold=bool(d["wait_from_cold"]),
        read_s=_ema(d["read_s"]),
        answer_len=_ema(d["answer_len"]),
        copy=CopyCosts(
            accept=[_positions(x) for x in c["accept"]],
            skipped=[int(x) for x in c["skipped"]],
        ),
    )


def to_dict(host: HostCosts) -> dict:
    return asdict(host)


def load_costs(path: str | Path) -> HostCosts | None:
    """The costs stored at ``path``, or None (no file, another version, or damaged)."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
        if doc.get("version") != VERSION:
            return None
        return from_dict(doc["costs"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the stored decoding costs in %s: %s", p, exc)
        return None


def save_costs(host: HostCosts, path: str | Path) -> None:
    """Write ``host`` to ``path`` (a temporary file renamed into place); failures are logged."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": VERSION, "costs": to_dict(host)}))
        tmp.replace(p)
    except OSError as exc:
        log.warning("could not store the decoding costs in %s: %s", p, exc)
