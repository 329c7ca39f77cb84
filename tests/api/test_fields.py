"""vLLM's and OpenAI's request fields over HTTP, on a tiny random Qwen3 with a drafter.

Penalties, ``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``n`` and
``logprobs`` (chat and completions), each checked against what the engine must produce (the
penalised reference of tests/engine/test_penalties_exact.py, greedy decoding for a top-k of 1),
the body vLLM's benchmark client sends, unknown fields still refused, and the stream's first
chunk leaving with the first token rather than before the prompt is read.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from openai import OpenAI

from app.settings import ServeSettings
from d3d.config import SamplingConfig
from d3d.engine import Engine
from d3d.model.drafter import D3DDrafter
from d3d.model.load import LoadedModel
from d3d.sampling import log_distribution
from tests.api.conftest import free_port, start
from tests.conftest import tiny_model, tiny_tokenizer
from tests.engine.test_penalties_exact import fresh, next_logits, processed, reference

PROMPT_IDS = [1, 5, 9, 22, 7]
PROMPT = " ".join(f"w{i}" for i in PROMPT_IDS)
EOS = 40  # the tiny Qwen3's greedy answer to PROMPT reaches it at its 9th token


def model():
    return tiny_model("qwen3", seed=1)


def engine_factory(settings) -> Engine:
    m = model()
    m.generation_config.eos_token_id = [m.config.eos_token_id, EOS]
    drafter = D3DDrafter.from_target(m, 1)
    return Engine(LoadedModel(model=m, tokenizer=tiny_tokenizer(), spec="tiny"), drafter)


@pytest.fixture(scope="module")
def srv():
    s = start(ServeSettings(port=free_port(), served_model_name="tiny"), engine_factory)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def chat(client, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], **kw
    )


def stream_chunks(srv, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_eos_min_tokens_ignore_eos_and_stop_token_ids(client):
    eos = {EOS, model().config.eos_token_id}
    plain = chat(client, max_tokens=24).choices[0]
    ref = reference(model(), PROMPT_IDS, SamplingConfig(), eos)
    assert ids(plain.message.content) == ref and ref[-1] == EOS and len(ref) < 24
    assert plain.finish_reason == "stop"  # (w40 is no special token: it stays in the text)
    r = chat(client, max_tokens=24, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    r = chat(client, max_tokens=24, extra_body={"min_tokens": 12})
    ref = reference(model(), PROMPT_IDS, SamplingConfig(min_tokens=12), eos, n=24)
    assert r.usage.completion_tokens == len(ref) and len(ref) > 12
    free = reference(model(), PROMPT_IDS, SamplingConfig(ignore_eos=True), set(), n=24)
    at = free.index(fresh(free, 10))
    r = chat(client, extra_body={"ignore_eos": True, "stop_token_ids": [free[at]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == at + 1
    assert ids(r.choices[0].message.content) == free[:at]  # the stop id stays out of the text


@pytest.mark.parametrize("mode", ["ar", "sync", "auto"])
def test_penalties_greedy_equal_the_reference_in_every_mode(client, mode):
    kw = {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.2}
    r = chat(client, extra_body={**kw, "ignore_eos": True, "speculative": {"mode": mode}})
    ref = reference(model(), PROMPT_IDS, SamplingConfig(**kw, ignore_eos=True), set(), n=24)
    assert ids(r.choices[0].message.content) == ref
    if mode != "auto":  # auto speculates where its policy says it pays
        assert (r.model_extra["speculative"]["num_drafts"] > 0) == (mode == "sync")
    assert ref != reference(model(), PROMPT_IDS, SamplingConfig(ignore_eos=True), set(), n=24)


def test_top_k_one_and_min_p_one_sample_the_greedy_answer(client):
    greedy = chat(client, extra_body={"ignore_eos": True}).choices[0].message.content
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = chat(client, temperature=1.5, extra_body={"ignore_eos": True, **extra})
        assert r.choices[0].message.content == greedy, extra
    sampled = chat(client, temperature=1.5, seed=3, extra_body={"ignore_eos": True, "top_k": -1})
    assert sampled.choices[0].message.content != greedy  # top_k -1 is off, as in vLLM


def test_n_choices_streaming_and_not(client, srv):
    kw = dict(temperature=1.0, seed=5, n=3, max_tokens=12, extra_body={"ignore_eos": True})
    r = chat(client, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1 and r.usage.completion_tokens == 36
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 1.0, "seed": 5, "n": 3,
            "max_tokens": 12, "ignore_eos": True}  # fmt: skip
    chunks = stream_chunks(srv, body)
    got, firsts, finish = ["", "", ""], [], {}
    for c in chunks:
        for ch in c["choices"]:
            if "role" in ch["delta"]:
                firsts.append(ch["index"])
            got[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert got == texts and sorted(firsts) == [0, 1, 2]
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 36


def test_chat_logprobs_are_the_penalised_distribution(client, srv):
    cfg = SamplingConfig(frequency_penalty=0.5)
    r = chat(client, max_tokens=8, logprobs=True, top_logprobs=2,
             extra_body={"frequency_penalty": 0.5, "ignore_eos": True})  # fmt: skip
    content = r.choices[0].logprobs.content
    toks = ids(r.choices[0].message.content)
    assert [int(e.token[1:]) for e in content] == toks
    for i, e in enumerate(content):
        x = processed(next_logits(model(), PROMPT_IDS + toks[:i]), PROMPT_IDS, toks[:i], cfg, ())
        want = log_distribution(x[None], cfg)[0]
        assert e.logprob == pytest.approx(float(want[toks[i]]), abs=1e-4)
        assert e.bytes == list(e.token.encode())
        assert [t.token for t in e.top_logprobs] == [f"w{j}" for j in want.topk(2).indices]
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": 8, "logprobs": True, "top_logprobs": 2, "frequency_penalty": 0.5,
            "ignore_eos": True}  # fmt: skip
    streamed = [e for c in stream_chunks(srv, body) for ch in c["choices"]
                for e in ((ch.get("logprobs") or {}).get("content") or [])]  # fmt: skip
    # Tokens are exact; log-probabilities agree to float rounding (a streamed request may share a
    # step with other rows, and a batched forward rounds differently).
    assert [e["token"] for e in streamed] == [e.token for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert chat(client, max_tokens=4).choices[0].logprobs is None


def test_completion_logprobs_shape(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text.replace(" ", "")
    assert all(
        len(t) == 2 and max(t.values()) >= lp.token_logprobs[0] - 10 for t in lp.top_logprobs
    )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    greedy = torch.tensor(lp.token_logprobs)
    assert (greedy <= 0).all()


def test_the_body_vllm_bench_sends(srv):
    """vllm bench serve --backend openai-chat --dataset-name random: every answer its length."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text",
            "text": PROMPT}]}], "max_completion_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.0, "top_p": 1.0}  # fmt: skip
    chunks = stream_chunks(srv, body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "content" in chunks[0]["choices"][0]["delta"]
    assert chunks[-1]["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 30, "max_tokens": 8}, "min_tokens"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_fields_are_refused_naming_them(srv, change, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **change}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text


def test_the_first_chunk_leaves_with_the_first_token(srv):
    """Held steps: the response has started, yet no chunk comes until a token exists."""
    batch, gate = srv.worker.batch, threading.Event()
    step = batch.step
    batch.step = lambda: (gate.wait(10), step())
    first: list = []
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": 4}  # fmt: skip

    def read():
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first.append((time.perf_counter(), json.loads(line[6:])))
                    return

    try:
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)
        assert not first, "a chunk left before any token was decoded"
        opened = time.perf_counter()
        gate.set()
        reader.join(10)
    finally:
        batch.step = step
    at, chunk = first[0]
    assert at >= opened
    delta = chunk["choices"][0]["delta"]
    assert delta["role"] == "assistant" and delta["content"]
