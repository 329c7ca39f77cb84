"""Faults tried on purpose over real sockets, on a tiny random model: a hundred clients that
leave mid-stream, a queue that overflows under real contention, a request that times out among
others. After each, the running-requests, queue and KV gauges of ``/metrics`` are back to zero,
what the server accepted is answered in full (the same text as alone), and the next request is
served. (``test_concurrency_edges.py`` has the single-request versions with a paused worker.)

The engine is slowed where a test needs requests to overlap (a pause before every target
forward), so the outcome does not hang on how fast this host is: the faults are forced, not
raced.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import Live, tiny_server

GAUGES = ("d3d_running_requests", "d3d_queue_depth", "d3d_kv_tokens_in_use")


def chat(content: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream, "speculative": {"mode": "ar"}}  # fmt: skip


def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of ``/metrics`` (gauges, counters' ``_total``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}  # fmt: skip


def settled(srv: Live, within: float) -> dict[str, float]:
    """``/metrics`` once the gauges read zero (or after ``within`` seconds: the caller's
    assertions then show what was left)."""
    deadline = time.time() + within
    while True:
        m = metrics(srv.url)
        if all(m[g] == 0 for g in GAUGES) or time.time() > deadline:
            return m
        time.sleep(0.05)


def assert_nothing_left(srv: Live, m: dict[str, float]) -> None:
    assert {g: m[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0.0)
    batch = srv.worker.batch
    assert not batch.rows and not batch.waiting and batch.kv.reserved == 0


def answer(url: str, body: dict) -> str:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@contextlib.contextmanager
def slowed(srv: Live, seconds: float):
    """Every target forward (one engine step) takes at least ``seconds`` longer."""
    hook = srv.worker.engine.target.model.register_forward_pre_hook(lambda *_: time.sleep(seconds))
    try:
        yield
    finally:
        hook.remove()


def test_a_hundred_clients_leaving_mid_stream_leave_no_row_and_no_kv():
    srv = tiny_server(max_queue=128)
    try:
        alone = answer(srv.url, chat("w9 w8", 32))
        before = metrics(srv.url)["d3d_generation_tokens_total"]

        async def leave(client: httpx.AsyncClient, i: int) -> None:
            body = chat(f"w{5 + i % 50} w{7 + i % 30}", 400, stream=True)
            async with client.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 1 + i % 3:  # the role chunk, or one or two of text too
                        return

        async def storm() -> None:
            limits = httpx.Limits(max_connections=110)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                await asyncio.gather(*(leave(client, i) for i in range(100)))

        asyncio.run(storm())
        m = settled(srv, within=5)
        assert_nothing_left(srv, m)
        # The rows stopped when their clients left: a few tokens each, not 100 x 400.
        assert m["d3d_generation_tokens_total"] - before < 100 * 400 / 10
        assert answer(srv.url, chat("w9 w8", 32)) == alone
    finally:
        srv.stop()


def test_a_full_queue_under_load_refuses_with_retry_after_and_loses_nothing_it_took():
    """16 clients at once against 4 batch slots and a queue of 2: the overflow gets 503 with
    Retry-After at once; every request the server took is answered in full, and clients that
    honour Retry-After all get their answer in the end."""
    srv = tiny_server(max_queue=2, max_batch=4)
    prompts = [f"w{3 + i % 4} w{11 + i % 4}" for i in range(16)]
    try:
        alone = {p: answer(srv.url, chat(p, 32)) for p in set(prompts)}
        rejected_before = metrics(srv.url)["d3d_rejected_requests_total"]

        async def client(c: httpx.AsyncClient, prompt: str) -> tuple[list[int], str]:
            statuses = []
            while len(statuses) < 30:
                r = await c.post(srv.url + "/v1/chat/completions", json=chat(prompt, 32))
                statuses.append(r.status_code)
                if r.status_code != 503:
                    return statuses, r.json()["choices"][0]["message"]["content"]
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "server_busy"
                await asyncio.sleep(float(r.headers["retry-after"]))
            return statuses, ""

        async def crowd() -> list[tuple[list[int], str]]:
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(client(c, p) for p in prompts))

        with slowed(srv, 0.01):  # 32 tokens take >= 0.3 s: the 16 arrive while 6 are held
            results = asyncio.run(crowd())
        statuses = [s for ss, _ in results for s in ss]
        assert {s for ss, _ in results for s in ss[-1:]} == {200}
        assert [text for _, text in results] == [alone[p] for p in prompts]
        assert statuses.count(503) >= 16 - 6  # at most 4 running + 2 queued at the first try
        m = settled(srv, within=5)
        assert m["d3d_rejected_requests_total"] - rejected_before == statuses.count(503)
        assert_nothing_left(srv, m)
    finally:
        srv.stop()


def test_a_request_timing_out_leaves_the_others_and_the_gauges_alone():
    srv = tiny_server(request_timeout=1.5)
    shorts = [f"w{20 + i} w{40 + i}" for i in range(6)]
    try:
        alone = [answer(srv.url, chat(p, 8)) for p in shorts]
        long: dict = {}

        def long_request() -> None:  # 400 steps of >= 10 ms: past its 1.5 s
            r = httpx.post(srv.url + "/v1/chat/completions", json=chat("w2", 400), timeout=60)
            long.update(status=r.status_code, body=r.json(), at=time.time())

        with slowed(srv, 0.01):
            t = threading.Thread(target=long_request)
            t.start()
            deadline = time.time() + 5
            while (m := metrics(srv.url))["d3d_running_requests"] < 1 and time.time() < deadline:
                time.sleep(0.02)
            assert m["d3d_running_requests"] == 1 and m["d3d_kv_tokens_in_use"] > 400
            with httpx.Client(timeout=60) as c:
                others = [c.post(srv.url + "/v1/chat/completions", json=chat(p, 8)) for p in shorts]
            t.join(30)
            assert long["status"] == 504 and long["body"]["error"]["type"] == "timeout"
            m = settled(srv, within=1.0)  # the row would run ~2.5 s more if not dropped
        assert [r.status_code for r in others] == [200] * len(shorts)
        assert [r.json()["choices"][0]["message"]["content"] for r in others] == alone
        assert_nothing_left(srv, m)
        assert answer(srv.url, chat(shorts[0], 8)) == alone[0]
    finally:
        srv.stop()
