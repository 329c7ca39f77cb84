"""The engine's scheduler on the real embedded target (SmolLM2-135M, fp32 CPU): rows joining at
different steps, in ar / auto / sync / async modes, produce exactly the target's plain greedy
output (the same engine, one request at a time)."""

from __future__ import annotations

import pytest

from d3d.config import DecodeConfig, ModelConfig
from d3d.engine import Engine, GenRequest

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of Japan?",
    "Give two reasons to learn a second language.",
    "Explain recursion to a child.",
]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_config(ModelConfig(threads=2))


def test_batched_rows_equal_plain_greedy(engine):
    n = 24
    ref = [engine.generate(p, DecodeConfig(mode="ar", max_new_tokens=n)).token_ids for p in PROMPTS]
    batch = engine.scheduler()
    outs: list[list[int]] = [[] for _ in PROMPTS]
    stats = [None] * len(PROMPTS)
    modes = ["ar", "auto", "sync", "async"]

    def add(i: int) -> None:
        def done(s, err, i=i):
            assert err is None
            stats[i] = s

        batch.add(
            GenRequest(
                engine.encode(PROMPTS[i]),
                n,
                mode=modes[i],
                on_tokens=outs[i].extend,
                on_finish=done,
            )
        )

    add(0)
    add(1)
    for i in (2, 3):
        batch.step()
        batch.step()
        add(i)
    while not batch.idle:
        batch.step()
    assert outs == ref
    assert stats[2].num_drafts > 0 and stats[0].num_drafts == 0
