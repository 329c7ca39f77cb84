"""The GPU check's vLLM stage: the same random target served by vLLM alone and by vLLM with the
D3D proposer (its drafter on the second GPU when there is one), concurrent greedy requests.

:func:`run_vllm` saves the check's random-weight target to a folder (no tokenizer: token ids
only), then starts vLLM twice on it (eager, to fit the check's time limit): without speculation,
then with ``d3d.vllm.D3DProposer`` (drafter ``self:N`` of the same folder, on ``cuda:1`` if
there are two GPUs, else beside the target). Per engine and mode: ``requests`` concurrent greedy
requests of ``prompt_tokens`` random ids and ``new_tokens`` new ones, all added at once; it
reports throughput, whether every answer equals vLLM alone's, vLLM's acceptance counters, the
proposer's branch hits and misses, and the device memory in use while the engine ran. Without
vLLM (``pip install -e '.[vllm]'``), the stage says so and is skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

MODES = ("sync", "async", "auto")


def _memory_gb() -> list[float]:
    """Memory in use on every GPU (any process), GB."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(round((total - free) / 1e9, 2))
    return out


def _engine(path: str, dtype: str, speculative: dict | None, share: float, window: int):
    from vllm import LLM

    kw: dict = {"gpu_memory_utilization": share} if torch.cuda.is_available() else {}
    return LLM(
        model=path,
        dtype=dtype,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=window,
        max_num_seqs=64,
        speculative_config=speculative,
        disable_log_stats=False,
        **kw,
    )


def _run(llm, prompts: list[list[int]], new_tokens: int, mode: str | None) -> tuple[list, float]:
    from vllm import SamplingParams

    extra = {"d3d_mode": mode} if mode else None
    sp = SamplingParams(
        max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra
    )
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def run_vllm(
    target,
    requests: int,
    prompt_tokens: int,
    new_tokens: int,
    drafter: str,
    time_left: Callable[[], float],
) -> dict:
    """The stage's figures (see the module docstring)."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed here (pip install -e '.[vllm]')"}
    from d3d.vllm.stats import StatsClient

    gpus = torch.cuda.device_count()
    if not gpus:  # vLLM's CPU build sizes its KV from this variable
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    dtype = "bfloat16" if gpus else "float32"
    drafter_device = "cuda:1" if gpus >= 2 else ("cuda:0" if gpus else "cpu")
    g = torch.Generator().manual_seed(0)
    vocab = int(target.config.vocab_size)
    prompts = [
        torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(requests)
    ]
    out: dict = {"gpus": gpus, "drafter": drafter, "drafter_device": drafter_device}
    with tempfile.TemporaryDirectory(prefix="d3d-gpu-vllm-") as tmp:
        path = str(Path(tmp) / "target")
        t0 = time.perf_counter()
        target.save_pretrained(path)
        out["save_s"] = round(time.perf_counter() - t0, 1)
        share = 0.35 if gpus < 2 else 0.6
        window = prompt_tokens + new_tokens + 16
        llm = _engine(path, dtype, None, share, window)
        try:
            ref, seconds = _run(llm, prompts, new_tokens, None)
            out["alone"] = {
                "tokens_per_s": round(requests * new_tokens / seconds, 1),
                "memory_gb": _memory_gb(),
            }
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
        if time_left() < 60:
            out["error"] = "no time left for vLLM with the D3D proposer"
            return out
        sock = str(Path(tmp) / "stats.sock")
        env = {
            "D3D_TARGET": path,
            "D3D_DRAFTER": drafter,
            "D3D_DRAFTER_DEVICE": drafter_device,
            "D3D_VLLM_STATS": sock,
            "D3D_BRANCHES": "",
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        spec = {
            "method": "custom_class",
            "model": "d3d.vllm.D3DProposer",
            "num_speculative_tokens": 15,
        }
        llm = _engine(path, dtype, spec, share, window)
        try:
            stats = StatsClient(sock)
            end = time.monotonic() + 120
            while time.monotonic() < end:
                t = stats.ask("totals")
                if isinstance(t, dict) and (t.get("worker") or {}).get("state") == "up":
                    break
                time.sleep(0.5)
            for mode in MODES:
                if time_left() < 20:
                    out.setdefault("skipped_modes", []).append(mode)
                    continue
                before = (
                    _counter(llm, "vllm:spec_decode_num_drafts"),
                    _counter(llm, "vllm:spec_decode_num_accepted_tokens"),
                )
                hits0 = stats.ask("totals") or {}
                outs, seconds = _run(llm, prompts, new_tokens, mode)
                hits1 = stats.ask("totals") or {}
                drafts = _counter(llm, "vllm:spec_decode_num_drafts") - before[0]
                accepted = _counter(llm, "vllm:spec_decode_num_accepted_tokens") - before[1]
                out[mode] = {
                    "tokens_per_s": round(requests * new_tokens / seconds, 1),
                    "x_alone": round(
                        requests * new_tokens / seconds / out["alone"]["tokens_per_s"], 3
                    ),
                    "identical": sum(a == b for a, b in zip(outs, ref, strict=True)),
                    "requests": requests,
                    "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                    "branch_hits": hits1.get("branch_hits", 0) - hits0.get("branch_hits", 0),
                    "branch_misses": hits1.get("branch_misses", 0) - hits0.get("branch_misses", 0),
                    "memory_gb": _memory_gb(),
                }
            out["worker"] = (stats.ask("totals") or {}).get("worker")
        finally:
            llm.llm_engine.engine_core.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return out


def vllm_errors(res: dict) -> list[str]:
    """What the stage found wrong: answers that differ from vLLM alone's."""
    errs = []
    for mode in MODES:
        m = res.get(mode)
        if isinstance(m, dict) and m.get("identical") != m.get("requests"):
            errs.append(
                f"{mode}: {m.get('identical')}/{m.get('requests')} answers equal vLLM alone"
            )
    with contextlib.suppress(TypeError):
        if res.get("error"):
            errs.append(res["error"])
    return errs
