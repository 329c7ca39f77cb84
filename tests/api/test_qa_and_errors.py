"""/qa (JSON, multipart .txt/.md/.pdf, streaming), /metrics, and every bad input answered with the
right status, a named field and a request id, never a 5xx. Live server, real default model."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.pdfs import text_pdf

pytestmark = pytest.mark.slow

DOC = (
    "The Eiffel Tower is a wrought-iron lattice tower in Paris. It was completed in 1889. "
    "Gustave Eiffel's company designed and built it. Bananas are yellow and grow in bunches. "
    "The Moon orbits the Earth about once a month. Honey never spoils if it is kept sealed."
)
Q = "When was the Eiffel Tower completed?"
BASE = {"document": DOC, "question": Q, "max_new_tokens": 6, "scorer": "bm25", "keep_ratio": 0.5}


def check_spans(body: dict, document: str) -> None:
    comp = body["compression"]
    spans = comp["kept_spans"]
    assert spans, comp
    assert all(0 <= s < e <= len(document) for s, e in spans)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))
    assert comp["kept_context_tokens"] <= comp["context_tokens"]


def test_qa_json(live):
    r = httpx.post(live.url + "/qa", json=BASE, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["answer"] and body["usage"]["completion_tokens"] == 6
    check_spans(body, DOC)
    assert body["compression"]["scorer"] == "bm25"
    assert {"num_drafts", "acceptance_length", "mode"} <= set(body["speculative"])
    assert {"queue_s", "compress_s", "prefill_s", "decode_s", "total_s"} <= set(body["timings"])
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("name", ["doc.txt", "doc.md", "doc.pdf"])
def test_qa_multipart(live, name):
    data = text_pdf(DOC) if name.endswith(".pdf") else DOC.encode()
    fields = {k: str(v) for k, v in BASE.items() if k != "document"}
    r = httpx.post(live.url + "/qa", data=fields, files={"file": (name, data)}, timeout=300)
    assert r.status_code == 200, r.text
    assert "Eiffel" in "".join(
        DOC[s:e] for s, e in r.json()["compression"]["kept_spans"]
    ) or name.endswith(".pdf")


def test_qa_stream(live):
    events = []
    with httpx.stream("POST", live.url + "/qa", json={**BASE, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[0]["type"] == "compression" and parsed[-1]["type"] == "done"
    text = "".join(e["text"] for e in parsed if e["type"] == "delta")
    assert text.strip() == parsed[-1]["answer"]


def bad(live, path="/qa", **kw):
    r = httpx.post(live.url + path, timeout=120, **kw)
    assert r.status_code < 500, r.text
    body = r.json()
    assert body["request_id"] == r.headers["x-request-id"]
    assert "Traceback" not in r.text
    return r.status_code, body["error"]


CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ({**BASE, "document": ""}, 422, "document"),
        ({**BASE, "document": "   "}, 422, "document"),
        ({**BASE, "keep_ratio": 0}, 422, "keep_ratio"),
        ({**BASE, "keep_ratio": 1.5}, 422, "keep_ratio"),
        ({**BASE, "scorer": "magic"}, 422, "scorer"),
        ({**BASE, "speculative": {"mode": "turbo"}}, 422, "speculative.mode"),
        ({**BASE, "max_new_tokens": "many"}, 422, "max_new_tokens"),
        ({**BASE, "temperature": -1}, 422, "temperature"),
        ({**BASE, "temperature": 0.7, "seed": 2**69}, 422, "seed"),  # past a 64-bit generator
        ({**BASE, "document": ["a", "list"]}, 422, "document"),
        ({**BASE, "colour": "blue"}, 422, "colour"),
        ({k: v for k, v in BASE.items() if k != "question"}, 422, "question"),
    ],
)
def test_qa_bad_input(live, payload, status, param):
    code, err = bad(live, json=payload)
    assert (code, err["param"]) == (status, param), err
    assert param.split(".")[-1] in err["message"]


def test_malformed_json_and_wrong_content_type(live):
    code, err = bad(
        live, content=b'{"document": "x",', headers={"content-type": "application/json"}
    )
    assert code == 400 and "JSON" in err["message"]
    code, _ = bad(live, content=b"x", headers={"content-type": "text/csv"})
    assert code == 415


def test_oversized_document_and_body(live):
    long_doc = "word " * 4000  # > max_document_tokens (3000)
    code, err = bad(live, json={**BASE, "document": long_doc})
    assert code == 413 and "3000" in err["message"]
    code, err = bad(live, content=b"x" * 2_100_000, headers={"content-type": "application/json"})
    assert code == 413 and "2000000" in err["message"]


def test_prompt_longer_than_the_window(live):
    prompt = "hello " * 9000
    code, err = bad(
        live, "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 4}
    )
    assert code == 400 and "8192" in err["message"] and "max_tokens" not in err["message"]
    assert "9000" in err["message"] or "900" in err["message"]


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"model": "gpt-9"}, 404, "model"),
        ({"n": 0}, 422, "n"),
        ({"messages": []}, 422, "messages"),
        ({"temperature": "hot"}, 422, "temperature"),
        ({"temperature": 1.0, "seed": -(2**63) - 1}, 422, "seed"),
        ({"logit_bias": {}}, 422, "logit_bias"),
        ({"speculative": {"mode": "fast"}}, 422, "speculative.mode"),
        ({"keep_ratio": 0.5}, 422, "keep_ratio"),
    ],
)
def test_chat_bad_input(live, change, status, param):
    code, err = bad(live, "/v1/chat/completions", json={**CHAT, **change})
    assert (code, err["param"]) == (status, param), err


def test_metrics_parse_and_count(live):
    httpx.post(live.url + "/qa", json={**BASE, "speculative": {"mode": "sync"}}, timeout=300)
    text = httpx.get(live.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "d3d_requests",
        "d3d_request_latency_seconds",
        "d3d_time_to_first_token_seconds",
        "d3d_generation_tokens",
        "d3d_queue_depth",
        "d3d_running_requests",
        "d3d_spec_decode_num_drafts",
        "d3d_spec_decode_num_accepted_tokens",
        "d3d_spec_decode_num_accepted_tokens_per_pos",
        "d3d_spec_decode_branch_hits",
        "d3d_compression_keep_ratio",
        "d3d_request_tokens_per_second",
    ):
        assert name in fams, name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples
    }
    ok_qa = samples[
        ("d3d_requests_total", (("method", "POST"), ("route", "/qa"), ("status", "200")))
    ]
    assert ok_qa >= 1
    assert samples[("d3d_spec_decode_num_drafts_total", ())] >= 1
    assert samples[("d3d_time_to_first_token_seconds_count", ())] >= 1
    assert any(k[0] == "d3d_requests_total" and ("status", "422") in k[1] for k in samples)
