"""``d3d serve --engine vllm --target FOLDER`` for a target with no trained drafter: a random
Qwen3 (the real Qwen3 tokenizer, head_dim 64 for vLLM's CPU attention) is served by vLLM alone,
on purpose: ``/ready`` says speculation is off and why, chat and ``/qa`` answer, and a request
for a drafter's mode is told why it cannot have one (as on the own engine:
tests/api/test_no_drafter.py)."""

from __future__ import annotations

import os

import httpx
import pytest

from app.settings import ServeSettings
from d3d.config import ModelConfig
from tests.api.conftest import free_port, start
from tests.conftest import qwen3_like, save_qwen3
from tests.vllm.conftest import restored_environ

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
DOC = " ".join(f"Fact {i}: {i} is {'odd' if i % 2 else 'even'}." for i in range(40))


@pytest.fixture(scope="module")
def served(tmp_path_factory, qwen3_tokenizer):
    folder = save_qwen3(
        qwen3_like(head_dim=64), qwen3_tokenizer, tmp_path_factory.mktemp("qwen3_vllm")
    )
    settings = ServeSettings(
        model=ModelConfig(target=str(folder)),
        port=free_port(),
        engine="vllm",
        vllm_eager=True,
        max_batch=4,
        served_model_name="qwen3-tiny",
    )
    with restored_environ():  # what the server's vLLM set up for its processes stays theirs
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # ample here, and allocated whole at start
        srv = start(settings)
    yield srv
    srv.stop()


def test_vllm_serves_a_target_without_a_drafter_with_speculation_off(served):
    body = httpx.get(served.url + "/ready", timeout=10).json()
    assert body["status"] == "ready" and body["engine"] == "vllm"
    assert body["speculation"] == "off" and body["drafter"] is None
    assert "no trained drafter" in body["speculation_reason"]
    chat = {
        "model": "qwen3-tiny",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    }
    r = httpx.post(served.url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    qa = {"document": DOC, "question": "Is 7 odd?", "max_new_tokens": 6, "scorer": "bm25"}
    r = httpx.post(served.url + "/qa", json=qa, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(served.url + "/qa", json={**qa, "speculative": {"mode": "async"}}, timeout=60)
    assert r.status_code == 400 and "speculation is off" in r.json()["error"]["message"]
