"""A target with no trained drafter is served without speculation, on purpose.

The server loads a random Qwen3 (the real Qwen3 tokenizer) by folder through the real loader,
with the default drafter spec: no drafter is trained for it, so speculation is off, ``/ready``
says so and why, chat and ``/qa`` answer, and a request that asks for a drafter's mode is told
why it cannot have one. A drafter named explicitly that cannot be loaded fails at start with a
one-line error naming the path.
"""

from __future__ import annotations

import httpx
import pytest

from app.settings import ServeSettings
from d3d.config import DecodeConfig, ModelConfig
from d3d.engine import Engine
from d3d.model.drafter import DrafterError
from d3d.model.specs import DEFAULT_DRAFTER_DIR, speculation
from tests.api.conftest import free_port, start

DOC = " ".join(f"Fact {i}: {i} is {'odd' if i % 2 else 'even'}." for i in range(40))


def test_the_default_spec_resolves_to_the_shipped_drafter_or_to_no_speculation():
    embedded = speculation("default", "default")
    assert embedded.on and embedded.drafter == str(DEFAULT_DRAFTER_DIR)
    off = speculation("default", "Qwen/Qwen3-8B")
    assert not off.on and "no trained drafter for Qwen/Qwen3-8B" in off.reason
    assert "d3d train" in off.reason and "--drafter" in off.reason
    assert off.to_dict() == {"speculation": "off", "speculation_reason": off.reason}
    assert (
        not speculation("none", "default").on
        and "--drafter none" in speculation("none", "x").reason
    )
    named = speculation("self:2", "Qwen/Qwen3-8B")  # a named choice is served as named
    assert named.on and named.to_dict() == {"speculation": "on", "speculation_reason": None}


def test_a_named_drafter_that_cannot_load_is_a_one_line_error(qwen3_dir, tmp_path):
    missing = tmp_path / "qwen3-8b-drafter"
    with pytest.raises(DrafterError, match=f"drafter checkpoint not found: {missing}$"):
        Engine.from_config(ModelConfig(target=str(qwen3_dir), drafter=str(missing)))


def test_the_engine_refuses_a_drafter_mode_with_the_same_reason(qwen3_dir):
    engine = Engine.from_config(ModelConfig(target=str(qwen3_dir)))
    assert engine.drafter is None and not engine.speculation.on
    with pytest.raises(DrafterError, match="mode 'sync' needs a drafter; speculation is off: no "
                       "trained drafter"):  # fmt: skip
        engine.generate("Say hello.", DecodeConfig(mode="sync", max_new_tokens=4))
    assert engine.generate("Say hello.", DecodeConfig(mode="ar", max_new_tokens=4)).token_ids


@pytest.fixture(scope="module")
def server(qwen3_dir):
    settings = ServeSettings(
        model=ModelConfig(target=str(qwen3_dir)),
        port=free_port(),
        served_model_name="qwen3-tiny",
        request_timeout=60.0,
    )
    srv = start(settings)  # the real loader: Engine.from_config
    yield srv
    srv.stop()


def test_ready_says_speculation_is_off_and_why(server):
    body = httpx.get(server.url + "/ready", timeout=10).json()
    assert body["status"] == "ready"
    assert body["speculation"] == "off" and body["drafter"] is None
    assert "no trained drafter" in body["speculation_reason"]
    assert server.worker.engine.drafter is None


def test_chat_and_qa_answer_without_a_drafter(server):
    chat = {
        "model": "qwen3-tiny",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    qa = {"document": DOC, "question": "Is 7 odd?", "max_new_tokens": 6, "scorer": "bm25"}
    r = httpx.post(server.url + "/qa", json=qa, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_drafter_mode_is_refused_with_the_reason(server, mode):
    qa = {"document": DOC, "question": "Is 7 odd?", "max_new_tokens": 6, "scorer": "bm25"}
    r = httpx.post(server.url + "/qa", json={**qa, "speculative": {"mode": mode}}, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"mode '{mode}' needs a drafter; speculation is off" in message
    assert "no trained drafter" in message
