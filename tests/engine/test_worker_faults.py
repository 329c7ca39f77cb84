"""A drafter worker process that misbehaves, under the engine: slow (its blocks miss their
deadline), or answering with bytes that are no message. Either way every request gets exactly
its ``ar`` tokens; a slow worker that still beats is kept, a garbled one is replaced."""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

import pytest

from d3d.config import DecodeConfig, ModelConfig
from d3d.engine import Engine
from d3d.engine.loading import DrafterFactory
from d3d.worker import modes
from d3d.worker.proposer import AsyncProposer
from d3d.worker.workers import available_cores
from tests.conftest import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores")
PROMPT = [5, 9, 14, 3, 22]


@dataclass(frozen=True)
class SlowFactory:
    """The drafter, each of whose forwards takes ``seconds`` longer (its heartbeat goes on)."""

    inner: DrafterFactory
    seconds: float

    def __call__(self):
        drafter = self.inner()
        forward = drafter.body

        def slow(*args, **kwargs):
            time.sleep(self.seconds)
            return forward(*args, **kwargs)

        drafter.body = slow
        return drafter


@dataclass(frozen=True)
class GarbleFactory:
    """The drafter, whose first block forward writes bytes that are no message to the parent."""

    inner: DrafterFactory

    def __call__(self):
        drafter = self.inner()
        forward = drafter.body
        fd = int(sys.argv[-1])  # python -m d3d.worker.child FD

        def garble(*args, **kwargs):
            os.write(fd, b"\x00\x00\x00\x08garbage!")
            return forward(*args, **kwargs)

        drafter.body = garble
        return drafter


@pytest.fixture
def engine(tmp_path):
    tiny_model("llama", seed=1).save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    cfg = ModelConfig(
        target=str(tmp_path / "m"), drafter="self:1", drafter_device=f"cpu:{available_cores()[-1]}"
    )
    engine = Engine.from_config(cfg)
    yield engine, cfg
    engine.close()


def test_a_slow_worker_costs_speculation_not_tokens_and_is_kept(engine, monkeypatch):
    engine, cfg = engine
    # A block's deadline of 1 s rather than the product's 5 s, and a worker 2 s slow: the same
    # miss at a fifth of the wait.
    monkeypatch.setattr(modes, "AsyncProposer", functools.partial(AsyncProposer, min_timeout=1.0))
    ref = engine.generate_ids(PROMPT, DecodeConfig(mode="ar", max_new_tokens=12)).token_ids
    engine.drafters.factory = SlowFactory(DrafterFactory(cfg), seconds=2.0)
    sup = engine.worker()
    assert sup is not None
    gen = engine.generate_ids(PROMPT, DecodeConfig(mode="async", max_new_tokens=12))
    assert gen.token_ids == ref
    assert gen.stats.worker_failures == 1, "its block missed the 1 s deadline"
    assert sup.restarts == 0 and sup.state == "up", "slow is not hung: it still beats"


def test_a_worker_that_sends_garbage_is_replaced(engine):
    engine, cfg = engine
    ref = engine.generate_ids(PROMPT, DecodeConfig(mode="ar", max_new_tokens=24)).token_ids
    engine.drafters.factory = GarbleFactory(DrafterFactory(cfg))
    sup = engine.worker()
    first = sup.status()["pid"]
    gen = engine.generate_ids(PROMPT, DecodeConfig(mode="async", max_new_tokens=24))
    assert gen.token_ids == ref
    end = time.monotonic() + 30
    while time.monotonic() < end and not (sup.restarts >= 1 and sup.alive):
        time.sleep(0.1)
    assert sup.restarts >= 1 and sup.alive and sup.status()["pid"] != first
    assert "unreadable" in sup.status()["last_error"]
