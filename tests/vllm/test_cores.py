"""Where vLLM computes on a CPU host beside the D3D drafter (:mod:`d3d.vllm.engine`): a drafter
given cores of its own holds them alone, vLLM's threads and processes keep to the others (on
vLLM's CPU build bound to every core, the drafter's branch work could only run after each verify,
and the branch budget prepared no branch); the default placement leaves vLLM every core. Nothing
here starts vLLM: the host's cores and the affinity calls are faked."""

from __future__ import annotations

import os

import pytest

from d3d.config import ConfigError, ModelConfig
from d3d.vllm.engine import on_vllm_cores, prepare_env, vllm_cores
from d3d.vllm.proposer import cores_shared_with_vllm


@pytest.fixture
def host(monkeypatch) -> list[set[int]]:
    """A two-core host: the calling thread's affinity, and every change made to it."""
    mask = {0, 1}
    changes: list[set[int]] = []

    def set_affinity(pid: int, cores) -> None:
        assert pid == 0
        changes.append(set(cores))
        mask.clear()
        mask.update(cores)

    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare_env's variables stay here
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        os.environ.pop(name, None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(mask))
    monkeypatch.setattr(os, "sched_setaffinity", set_affinity)
    return changes


def test_a_drafter_with_cores_of_its_own_keeps_vllm_off_them(host):
    cfg = ModelConfig(drafter_device="cpu:1")
    prepare_env(cfg)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0", "vLLM computes on the other core"
    with on_vllm_cores(cfg):
        assert os.sched_getaffinity(0) == {0}, "vLLM's processes start off the drafter's core"
    assert os.sched_getaffinity(0) == {0, 1}, "and the caller gets its cores back"
    assert cores_shared_with_vllm([1]) == []


def test_the_default_placement_leaves_vllm_every_core(host):
    cfg = ModelConfig()
    prepare_env(cfg)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    with on_vllm_cores(cfg):
        pass
    assert host == [], "nothing pinned"
    assert cores_shared_with_vllm([1]) == [1], "the proposer can say why no branch fits"


def test_a_caller_binding_wins_and_a_drafter_on_every_core_is_refused(host):
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
    prepare_env(ModelConfig(drafter_device="cpu:1"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    with pytest.raises(ConfigError, match="--drafter-device"):
        vllm_cores(ModelConfig(drafter_device="cpu:0-1"))
    assert vllm_cores(ModelConfig(target_device="cuda:0", drafter_device="cpu:1")) == [0, 1]
