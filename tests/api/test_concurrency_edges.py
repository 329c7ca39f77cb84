"""Server behaviour under pressure, on a tiny random model: API key, full queue, timeout,
client disconnect. The worker is paused deterministically (it stops taking jobs), not raced."""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest

from app.engines.own import SWITCH_S
from tests.api.conftest import tiny_server

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 4}


class Paused:
    """While inside, the engine worker takes no new jobs (they stay queued)."""

    def __init__(self, worker):
        self.worker = worker

    def __enter__(self):
        self.original = self.worker._take
        self.worker._take = lambda block: time.sleep(0.02)
        time.sleep(0.4)  # let a take already waiting on the inbox (0.2 s at most) return
        return self

    def __exit__(self, *exc):
        self.worker._take = self.original


def test_api_key_is_required_when_set():
    srv = tiny_server(api_key="s3cret")
    try:
        url = srv.url + "/v1/chat/completions"
        assert httpx.post(url, json=CHAT).status_code == 401
        r = httpx.post(url, json=CHAT, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(url, json=CHAT, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200, ok.text
        assert httpx.get(srv.url + "/health").status_code == 200  # probes stay open
    finally:
        srv.stop()


def test_full_queue_answers_503_with_retry_after(tiny):
    results: list[int] = []

    def call():
        results.append(
            httpx.post(tiny.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code
        )

    with Paused(tiny.worker):
        threads = [threading.Thread(target=call) for _ in range(2)]  # fill max_queue=2
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while tiny.worker.queue_depth < 2 and time.time() < deadline:
            time.sleep(0.02)
        r = httpx.post(tiny.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "queue is full" in r.json()["error"]["message"]
    for t in threads:
        t.join(30)
    assert results == [200, 200]  # the queued ones are served once the worker resumes


def test_timeout_answers_504_and_drops_the_job():
    srv = tiny_server(request_timeout=0.5)
    try:
        with Paused(srv.worker):
            r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        time.sleep(0.3)
        assert not srv.worker.batch.rows
    finally:
        srv.stop()


def test_client_disconnect_cancels_the_row(tiny):
    body = {
        **CHAT,
        "max_tokens": 400,
        "stream": True,
        "messages": [{"role": "user", "content": "w5"}],
        "speculative": {"mode": "ar"},
    }
    with httpx.stream("POST", tiny.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            break  # first chunk seen; leave
    deadline = time.time() + 10
    while time.time() < deadline and tiny.worker.batch.rows:
        time.sleep(0.05)
    assert not tiny.worker.batch.rows


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/qa"])
def test_garbage_never_gets_a_5xx(tiny, path):
    for payload in (b"", b"null", b"[]", b'{"model": 1}', b"\xff\xfe", b'{"messages": null}'):
        r = httpx.post(
            tiny.url + path, content=payload, headers={"content-type": "application/json"}
        )
        assert 400 <= r.status_code < 500, (payload, r.status_code, r.text)


def test_a_prompt_the_kv_budget_can_never_hold_is_refused_and_the_server_goes_on():
    """``--max-kv-tokens``: a /qa prompt that cannot fit is a 413 naming the KV limit; the next
    request is answered as usual."""
    from d3d.config import ModelConfig

    srv = tiny_server(model=ModelConfig(target="tiny", max_kv_tokens=256))
    try:
        document = " ".join(f"w{1 + i % 90}" for i in range(300))
        body = {"document": document, "question": "w5 w6", "keep_ratio": 1.0, "scorer": "bm25"}
        r = httpx.post(srv.url + "/qa", json=body, timeout=60)
        assert r.status_code == 413, r.text
        assert "KV limit is 256 tokens" in r.json()["error"]["message"]
        assert "--max-kv-tokens" in r.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert ok.status_code == 200, ok.text
        assert srv.worker.model_info["max_kv_tokens"] == 256
    finally:
        srv.stop()


def test_the_engine_thread_gets_the_gil_back_within_the_short_interval(tiny):
    # The engine thread and the event loop share the GIL; Python's 5 ms default hand-over
    # made every step wait behind the streaming (app.engines.own's docstring).
    assert tiny.worker.state == "ready"
    assert sys.getswitchinterval() <= SWITCH_S
