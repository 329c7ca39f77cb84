"""Input limits over real sockets (issue 45): every adversarial request is refused at once with a
4xx naming its limit, or served while ``/health`` keeps answering within a second.

A tiny random model behind a live server, with an API key and small limits: long and many stop
strings, large, deeply nested and malformed PDFs, chunked and oversized bodies, many
log-probabilities, unknown HTTP methods, non-ASCII bearer tokens, ``/ready`` without the key."""

from __future__ import annotations

import json
import random
import socket
import threading
import zlib
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.errors import ApiError
from app.settings import ServeSettings
from tests.api.conftest import tiny_server
from tests.api.pdfs import pdf

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 200_000
PAGES = 20


@pytest.fixture(scope="module")
def srv():
    server = tiny_server(
        api_key=KEY,
        max_body_bytes=BODY_LIMIT,
        max_pdf_pages=PAGES,
        max_document_tokens=100,  # a PDF's text may hold 3,200 characters (32 a token)
        request_timeout=60.0,
    )
    yield server
    server.stop()


def while_healthy(url: str, request: Callable[[], httpx.Response]) -> httpx.Response:
    """Run ``request`` on a thread; meanwhile ``/health`` must answer within 1 s, every time."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(request()))
    thread.start()
    polls = 0
    while thread.is_alive() or polls == 0:
        assert httpx.get(url + "/health", timeout=1.0).status_code == 200
        polls += 1
        thread.join(0.05)
    return out[0]


def refused(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for w in words:
        assert w in err["message"], err
    return err


def post(srv, path: str, body: dict | None = None, **kw) -> httpx.Response:
    headers = {**AUTH, **kw.pop("headers", {})}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60, **kw)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 4}


# -- per-request caps --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "param", "setting"),
    [
        ({"stop": ["w5" * 5000]}, "stop", "max-stop-chars"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "max-stop-sequences"),
        ({"n": 33}, "n", "max-n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "max-logprobs"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "max-stop-token-ids"),
        ({"max_tokens": 5000}, "max_tokens", "max-new-tokens"),
        ({"max_tokens": 600}, "max_tokens", "window"),  # the tiny model reads 512
    ],
)
def test_caps_refused_at_once_naming_the_limit(srv, change, param, setting):
    err = refused(post(srv, "/v1/chat/completions", {**CHAT, **change}), 422, setting)
    assert err["param"] == param


def test_completion_logprobs_cap(srv):
    body = {"model": "tiny", "prompt": "w1", "max_tokens": 2, "logprobs": 21}
    assert refused(post(srv, "/v1/completions", body), 422, "max-logprobs")["param"] == "logprobs"


def test_long_stop_strings_and_many_logprobs_stream_while_healthy(srv):
    """The longest stop strings allowed and every log-probability on many rows: served, and the
    event loop stays free."""
    body = {
        **CHAT,
        "stop": ["w7 " * 85, "w9" * 128],
        "max_tokens": 300,
        "n": 8,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
        "stream": True,
    }
    r = while_healthy(srv.url, lambda: post(srv, "/v1/chat/completions", body))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert len({c["choices"][0]["index"] for c in chunks if c["choices"]}) == 8
    tops = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    assert tops and all(len(e["top_logprobs"]) == 20 for t in tops for e in t["content"])


# -- bodies --------------------------------------------------------------------------------------
def raw(srv, head: bytes, chunks: list[bytes]) -> tuple[int, bytes]:
    """Send ``head`` and then ``chunks`` over a socket, stopping once the server answers; the
    status and the response."""
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        for chunk in chunks:
            s.settimeout(0.02)
            try:
                if data := s.recv(65536):  # answered early: stop sending
                    break
            except TimeoutError:
                data = b""
            s.settimeout(10)
            s.sendall(chunk)
        s.settimeout(10)
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            more = s.recv(65536)
            if not more:
                break
            data += more
    return int(data.split(b" ", 2)[1]), data


def chunked(path: str, body: bytes, size: int, auth: bool = True) -> tuple[bytes, list[bytes]]:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n" + (f"Authorization: Bearer {KEY}\r\n" if auth else "")
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return (head + "\r\n").encode(), [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/qa"])
def test_chunked_body_over_the_limit_is_413(srv, path):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "w1 " * 100_000}]})
    head, chunks = chunked(path, body.encode(), 16_384)
    status, data = raw(srv, head, chunks)
    assert status == 413 and str(BODY_LIMIT).encode() in data


def test_chunked_body_under_the_limit_is_served(srv):
    head, chunks = chunked("/v1/chat/completions", json.dumps(CHAT).encode(), 7)
    assert raw(srv, head, chunks)[0] == 200


def test_content_length_over_the_limit_is_413_at_once(srv):
    r = post(srv, "/v1/chat/completions", content=b"x" * (BODY_LIMIT + 1))
    refused(r, 413, str(BODY_LIMIT))


def test_key_checked_before_the_body(srv):
    """Without the key: 401, whatever the body (malformed, chunked, oversized)."""
    url = srv.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    refused(r, 401, "API key")
    head, chunks = chunked("/v1/chat/completions", b"x" * 500_000, 65_536, auth=False)
    assert raw(srv, head, chunks)[0] == 401
    assert httpx.post(srv.url + "/qa", content=b"x" * 10).status_code == 401


def test_non_ascii_bearer_is_401(srv):
    for token in ("ключ", "sekret-kéy", KEY + "\u00e9"):
        headers = {"Authorization": f"Bearer {token}".encode()}
        r = httpx.get(srv.url + "/v1/models", headers=headers, timeout=10)
        refused(r, 401, "API key")
    assert httpx.get(srv.url + "/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_ready_details_need_the_key(srv):
    bare = httpx.get(srv.url + "/ready", timeout=10).json()
    assert bare == {"status": "ready"}
    full = httpx.get(srv.url + "/ready", headers=AUTH, timeout=10).json()
    assert full["status"] == "ready" and "target" in full and "drafter_worker" in full


def test_unknown_methods_add_no_metric_series(srv):
    for method in ("FOO", "BREW", "X" * 40, "PROPFIND"):
        httpx.request(method, srv.url + "/health", timeout=10)
        httpx.request(method, srv.url + f"/nowhere/{method}", timeout=10)
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    methods = {
        s.labels["method"]
        for fam in text_string_to_metric_families(text)
        if fam.name == "d3d_requests"
        for s in fam.samples
    }
    assert "other" in methods and methods <= {"GET", "POST", "HEAD", "OPTIONS", "other"}


# -- PDFs ----------------------------------------------------------------------------------------
def text_page(text: str) -> bytes:
    return b"BT /F1 11 Tf 40 750 Td (" + text.encode() + b") Tj ET"


def upload(srv, data: bytes) -> httpx.Response:
    files = {"file": ("doc.pdf", data, "application/pdf")}
    form = {"question": "w1", "max_new_tokens": "2"}
    return httpx.post(srv.url + "/qa", files=files, data=form, headers=AUTH, timeout=60)


def test_pdf_with_too_many_pages_is_413(srv):
    r = while_healthy(srv.url, lambda: upload(srv, pdf([text_page("w1")] * (PAGES + 1))))
    assert refused(r, 413, "pages", "--max-pdf-pages")["param"] == "file"


def test_pdf_text_past_the_token_limit_stops_early(srv):
    """Pages of text more than 100 tokens could hold: 413 at the page that passes it."""
    r = while_healthy(srv.url, lambda: upload(srv, pdf([text_page("w5 " * 600)] * PAGES)))
    refused(r, 413, "by page 2", "--max-document-tokens")


def test_deeply_nested_pdf_is_422(srv):
    """Arrays nested 50,000 deep in a page and in its content stream: the parser's recursion
    gives out on a thread, the client hears 422 and the loop never stalls."""
    deep = b"[" * 50_000 + b"]" * 50_000
    in_page = pdf([text_page("w1")]).replace(b"/MediaBox", b"/Deep " + deep + b" /MediaBox")
    in_content = pdf([b"BT /F1 11 Tf " + deep + b" TJ ET"])
    r = while_healthy(srv.url, lambda: upload(srv, in_page))
    refused(r, 422, "cannot be read")
    r = while_healthy(srv.url, lambda: upload(srv, in_content))
    refused(r, 422, "nested too deeply")


def test_no_malformed_pdf_is_a_500(srv):
    good = pdf([text_page("w1 w2 w3")])
    bomb = zlib.compress(b"\0" * 120_000_000, 9)
    cases = [
        b"",
        b"%PDF-1.4",
        b"not a pdf at all",
        good[: len(good) // 2],
        good.replace(b"/Pages 2 0 R", b"/Pages 99 0 R"),
        good.replace(b"/Count 1", b"/Count -5"),
        good.replace(b"startxref\n", b"startxref\n999999"),
        pdf([b"BT /F1 11 Tf (unclosed Tj ET"]),
        pdf([b"x"]).replace(b"/Length 1", b"/Length 999999"),
        pdf([b""], extra=[b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(bomb) + bomb]),
        pdf([b""]).replace(b"/Contents 5 0 R", b"/Contents 7 0 R")
        + b"7 0 obj\n<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(bomb)
        + bomb
        + b"\nendstream\nendobj\n",
        good.replace(b"/Kids [4 0 R]", b"/Kids [1 0 R]"),  # a page tree that loops
    ]
    rng = random.Random(45)
    for _ in range(12):  # random bytes flipped in a good file
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cases.append(bytes(data))
    for data in cases:
        r = upload(srv, data)
        assert r.status_code < 500, (data[:80], r.text)
        assert "Traceback" not in r.text


# -- the rest of the edges -----------------------------------------------------------------------
def test_api_key_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("from-a-file\n")
    settings = ServeSettings.from_env(environ={"D3D_API_KEY_FILE": str(path)})
    assert settings.api_key == "from-a-file"
    explicit = ServeSettings.from_env(environ={"D3D_API_KEY_FILE": str(path)}, api_key="flag")
    assert explicit.api_key == "flag"


def test_a_500_keeps_its_text_in_the_log():
    """An engine's failure (vLLM's exception text, say) answers 'internal error' only."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from app import errors

    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom():
        raise ApiError(500, "RuntimeError: /secret/model/path exploded", kind="server_error")

    r = TestClient(app).get("/boom")
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error"
