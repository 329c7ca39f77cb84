"""vLLM's engine arguments from the project's model settings (``--target``, ``--drafter``,
``--device``, ``--drafter-device``, ``--max-kv-tokens``, ``--dtype``).

:func:`engine_args` gives the keyword arguments of vLLM's ``AsyncEngineArgs`` / ``LLM`` for a
:class:`~d3d.config.ModelConfig`: the target's weights (the embedded default: its converted
folder under ``~/.cache/d3d``), the dtype (``auto``: bf16 on CUDA, fp32 on a CPU, as the own
engine), the KV budget in bytes, and the D3D proposer as vLLM's ``custom_class`` speculative
method with K = block size - 1 (None where speculation is off, :func:`d3d.model.specs.speculation`: vLLM alone). :func:`prepare_env`
sets the variables the proposer reads in vLLM's model-runner process (``D3D_TARGET``,
``D3D_DRAFTER``, ``D3D_DRAFTER_DEVICE``, ..., and the path of the flag by which the engine core
skips empty draft round trips, :mod:`d3d.vllm.draft_fetch`, beside the statistics socket in the
caller's private folder), which inherits this process's
environment, and on a CPU host lets vLLM compute on every core (its default reserves one for its
front end) unless the caller set ``VLLM_CPU_*`` already.

A drafter given CPU cores of its own (``--drafter-device cpu:CORES``) holds them alone, as on the
own engine (:func:`d3d.engine.placement.resolve_placement`): vLLM computes on the other cores
(:func:`vllm_cores`), and its processes are started on them (:func:`on_vllm_cores`), since its
engine core busy-waits for the model runner through every forward. Without that, the drafter's
branch work for a step could only run once vLLM's forward let go of its core, and the branch
budget, rightly, would prepare none (``async`` would work as ``sync``). vLLM cannot move its
threads between steps as the own engine does (it binds them once and refuses
``torch.set_num_threads`` after), so the split holds for every step, plain ones included: the
default placement (the drafter on the last core, shared) keeps vLLM on every core.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from d3d.config import DEFAULT_BLOCK_SIZE, ConfigError, ModelConfig
from d3d.engine.placement import resolve_placement
from d3d.model.load import DEFAULT_SPECS, embedded_default_dir, hub_source
from d3d.model.specs import speculation
from d3d.vllm import PROPOSER, draft_fetch
from d3d.worker.reading import READER_ENV, ReaderSpec

FLAG = "drafted"  # the draft flag's name, in the statistics socket's private folder


def target_path(spec: str) -> str:
    """What vLLM loads for a target spec: the embedded default's folder, else the spec."""
    if spec.lower() in DEFAULT_SPECS:
        return str(embedded_default_dir())
    if spec.endswith(".gguf"):
        raise ValueError("--engine vllm serves a folder or a Hugging Face id, not a .gguf file")
    path = Path(spec).expanduser()
    return str(path) if path.exists() else spec  # a Hugging Face id (org/name@REVISION: pinned)


def speculative_config(cfg: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE) -> dict | None:
    """vLLM's ``speculative_config`` for the D3D proposer (None: no drafter)."""
    if not speculation(cfg.drafter, cfg.target).on:  # none asked for, or none trained
        return None
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": block_size - 1}


def engine_args(
    cfg: ModelConfig,
    *,
    served_name: str = "default",
    max_batch: int = 32,
    eager: bool = False,
    max_model_len: int | None = None,
    kv_bytes: int | None = None,
    **extra: object,
) -> dict:
    """Keyword arguments for vLLM's engine (see the module docstring). ``kv_bytes``: the KV
    budget in bytes (None: vLLM's default share of the device); ``eager``: no compilation
    (starts in seconds instead of minutes; tests); ``extra``: more of vLLM's arguments."""
    on_gpu = cfg.target_device.startswith("cuda")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    args: dict = {
        "model": target_path(cfg.target),
        "served_model_name": served_name,
        "dtype": dtype,
        "max_num_seqs": max_batch,
        "enforce_eager": eager,
        "disable_log_stats": False,
        "logprobs_mode": "processed_logprobs",  # logprobs of the distribution sampled from
    }
    if "@" in args["model"] and not Path(args["model"]).exists():  # org/name@REVISION
        args["model"], pin = hub_source(args["model"])
        args.update(pin)
    if max_model_len:
        args["max_model_len"] = max_model_len
    if kv_bytes:
        args["kv_cache_memory_bytes"] = int(kv_bytes)
    spec = speculative_config(cfg)
    if spec is not None:
        args["speculative_config"] = spec
    args.update(extra)
    return args


def prepare_env(
    cfg: ModelConfig,
    mode: str = "auto",
    stats_path: str | None = None,
    reader: ReaderSpec | None = None,
) -> None:
    """Set what the proposer reads in vLLM's runner process, and vLLM's CPU defaults;
    ``reader``: its drafter worker also reads the service's documents."""
    env = os.environ
    if reader is not None:
        env[READER_ENV] = json.dumps(reader.to_dict())
    else:
        env.pop(READER_ENV, None)
    env["D3D_TARGET"] = cfg.target
    env["D3D_DRAFTER"] = cfg.drafter
    env["D3D_DTYPE"] = cfg.dtype
    env["D3D_VLLM_MODE"] = mode
    if cfg.drafter_device:
        env["D3D_DRAFTER_DEVICE"] = cfg.drafter_device
    # The draft flag lies beside the statistics socket, in the caller's private folder
    # (d3d.worker.private); without one, vLLM keeps its draft round trip after every step.
    if stats_path:
        env["D3D_VLLM_STATS"] = stats_path
        env[draft_fetch.ENV] = os.path.join(os.path.dirname(os.path.abspath(stats_path)), FLAG)
    else:
        env.pop("D3D_VLLM_STATS", None)
        env.pop(draft_fetch.ENV, None)
    if not cfg.target_device.startswith("cuda"):
        cores = vllm_cores(cfg)
        contiguous = len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1))
        bind = f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def vllm_cores(cfg: ModelConfig) -> list[int]:
    """The CPU cores vLLM computes on: this process's, but those the drafter was given as its
    own (``--drafter-device cpu:CORES``; see the module docstring). Raises ConfigError naming
    ``--drafter-device`` when the drafter would leave vLLM none."""
    cores = sorted(os.sched_getaffinity(0))
    dev = cfg.drafter_device or ""
    if cfg.target_device.startswith("cuda") or not dev.startswith("cpu:"):
        return cores
    rest = list(resolve_placement(cfg.target_device, dev, cores).target_cores)
    if not rest:
        raise ConfigError(f"--drafter-device: {dev} leaves vLLM no core of {cores}")
    return rest


@contextlib.contextmanager
def on_vllm_cores(cfg: ModelConfig) -> Iterator[None]:
    """Start vLLM's engine inside this: where the drafter holds CPU cores of its own, the calling
    thread keeps to :func:`vllm_cores` meanwhile, so the processes vLLM starts (its engine core,
    which busy-waits for its model runner through every forward, and the runner) inherit them
    and never run on the drafter's. Elsewhere it does nothing."""
    cores = set(vllm_cores(cfg))
    before = os.sched_getaffinity(0)
    if cores == before:
        yield
        return
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
