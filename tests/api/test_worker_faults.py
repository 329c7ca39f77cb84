"""The drafter worker's faults tried on purpose over real sockets, on a tiny model saved to disk
whose drafter (its first layer) runs in its own process on the last core, as on a CPU host:
killed with SIGKILL and stopped with SIGSTOP under 16 streaming clients (a slow worker and one
that answers with something that is no message: ``tests/engine/test_worker_faults.py``). Every
request is answered with exactly the text it gets
alone, ``/ready`` shows the worker come back with a new pid and a restart counted, ``/metrics``
has its gauge and counter, and ``async`` requests afterwards are drafted again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest

from app.settings import ServeSettings
from d3d.config import ModelConfig
from d3d.worker.workers import available_cores
from tests.api.conftest import Live, free_port, start
from tests.api.test_faults import metrics, slowed
from tests.conftest import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores")
PROMPTS = [f"w{3 + i % 7} w{11 + i % 5} w{20 + i}" for i in range(16)]


def body(prompt: str, mode: str, max_tokens: int = 48, stream: bool = False) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": stream, "speculative": {"mode": mode}}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-worker") / "m"
    tiny_model("llama", seed=1).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def serve(path, **env) -> Live:
    os.environ.update(env)
    cores = available_cores()
    cfg = ModelConfig(target=str(path), drafter="self:1", drafter_device=f"cpu:{cores[-1]}")
    return start(ServeSettings(model=cfg, port=free_port(), served_model_name="tiny"))


def ready(url: str) -> dict:
    return httpx.get(url + "/ready", timeout=10).json()


def wait_worker(url: str, restarts: int, within: float) -> dict:
    end = time.time() + within
    while time.time() < end:
        w = ready(url).get("drafter_worker") or {}
        if w.get("state") == "up" and w.get("restarts", 0) >= restarts:
            return w
        time.sleep(0.2)
    raise AssertionError(f"the worker did not come back within {within} s: {ready(url)}")


async def stream_all(url: str, mode: str, on_first=None) -> list[str]:
    """16 concurrent streaming chats; ``on_first()`` runs once the first text chunk arrived."""
    fired = asyncio.Event()

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        async with client.stream("POST", url + "/v1/chat/completions",
                                 json=body(prompt, mode, stream=True)) as r:  # fmt: skip
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    text += delta.get("content") or ""
                    if text and on_first is not None and not fired.is_set():
                        fired.set()
                        on_first()
        return text

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))


@dataclass
class Alone:
    texts: list[str]  # each prompt's answer alone, without drafts


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = serve(tiny_dir)
    alone = Alone([httpx.post(srv.url + "/v1/chat/completions", json=body(p, "ar"),
                              timeout=60).json()["choices"][0]["message"]["content"]
                   for p in PROMPTS])  # fmt: skip
    yield srv, alone
    srv.stop()


def test_the_worker_killed_under_16_clients_is_replaced_and_drafts_again(server):
    srv, alone = server
    first = wait_worker(srv.url, 0, 60)
    m0 = metrics(srv.url)
    assert m0["d3d_drafter_worker_up"] == 1.0
    with slowed(srv, 0.01):
        texts = asyncio.run(
            stream_all(srv.url, "async", lambda: os.kill(first["pid"], signal.SIGKILL))
        )
    assert texts == alone.texts, "every request answered, identical to alone"
    again = wait_worker(srv.url, first["restarts"] + 1, 30)
    assert again["pid"] != first["pid"]
    m1 = metrics(srv.url)
    assert m1["d3d_drafter_worker_restarts_total"] >= m0["d3d_drafter_worker_restarts_total"] + 1
    before = m1["d3d_spec_decode_branch_hits_total"] + m1["d3d_spec_decode_branch_misses_total"]
    r = httpx.post(srv.url + "/v1/chat/completions", json=body(PROMPTS[0], "async"), timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == alone.texts[0]
    m2 = metrics(srv.url)
    after = m2["d3d_spec_decode_branch_hits_total"] + m2["d3d_spec_decode_branch_misses_total"]
    assert after > before, "the new worker drafts for async requests"


def test_a_stopped_worker_is_replaced_and_its_requests_finish_on_the_target(server):
    srv, alone = server
    first = wait_worker(srv.url, 0, 60)
    t0 = time.time()
    with slowed(srv, 0.01):
        texts = asyncio.run(
            stream_all(srv.url, "async", lambda: os.kill(first["pid"], signal.SIGSTOP))
        )
    assert texts == alone.texts
    assert time.time() - t0 < 60, "requests in flight finished within their timeout"
    again = wait_worker(srv.url, first["restarts"] + 1, 30)
    assert again["pid"] != first["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(first["pid"], signal.SIGKILL)  # the supervisor killed it; make sure
