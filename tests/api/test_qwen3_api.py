"""The service on a Qwen3 made like Qwen3-8B, through the OpenAI SDK and raw HTTP: chat is
non-thinking unless ``chat_template_kwargs`` enable thinking, and then the thinking comes back
apart as ``reasoning_content`` (streaming and not); ``/qa`` returns the exact prompt on request.

The served model is :func:`tests.conftest.scripted_qwen3`, loaded from its folder: after the
thinking-mode generation prompt it answers ``<think>`` reasoning ``</think>`` answer, after the
non-thinking prompt the answer alone, so the whole route (template, engine, detokeniser, split)
is exercised on the tags Qwen3 really emits.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from d3d.model.load import encode_messages
from tests.api.conftest import folder_server
from tests.conftest import ANSWER_TEXT, REASONING_TEXT

MODEL = "qwen3-tiny"
MSGS = [{"role": "user", "content": "Say hello."}]
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
DOC = " ".join(f"Fact {i}: {i} is {'odd' if i % 2 else 'even'}." for i in range(40))


@pytest.fixture(scope="module")
def server(scripted_qwen3_dir):
    srv = folder_server(scripted_qwen3_dir, MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, mode: str = "auto", **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=32,
        extra_body={"speculative": {"mode": mode}, **extra},
    )


def test_chat_is_non_thinking_by_default(client, qwen3_tokenizer):
    r = chat(client)
    msg = r.choices[0].message
    assert msg.content == ANSWER_TEXT and msg.model_extra["reasoning_content"] is None
    assert r.choices[0].finish_reason == "stop"
    prompt = encode_messages(qwen3_tokenizer, MSGS)
    assert qwen3_tokenizer.decode(prompt).endswith(EMPTY_THINK)
    assert r.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("mode", ["ar", "sync"])
def test_thinking_comes_back_apart_from_the_answer(client, qwen3_tokenizer, mode):
    r = chat(client, mode, **THINK)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == REASONING_TEXT
    assert msg.content == ANSWER_TEXT  # no tag, no blank line
    prompt = encode_messages(qwen3_tokenizer, MSGS, enable_thinking=True)
    assert r.usage.prompt_tokens == len(prompt)  # the thinking prompt: no empty think block
    assert r.usage.completion_tokens == len(qwen3_tokenizer(f"<think>{REASONING_TEXT}</think>\n\n{ANSWER_TEXT}")["input_ids"]) + 1  # fmt: skip


@pytest.mark.parametrize("thinking", [True, False])
def test_streaming_sends_reasoning_and_content_deltas(client, thinking):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=32,
            stream=True,
            extra_body={"speculative": {"mode": "ar"}, **(THINK if thinking else {})},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = [d.model_extra.get("reasoning_content") or "" for d in deltas]
    content = [d.content or "" for d in deltas]
    assert "".join(reasoning) == (REASONING_TEXT if thinking else "")
    assert "".join(content) == ANSWER_TEXT
    assert not any("think>" in c for c in content)
    if thinking:  # one token a round: the thinking streams in pieces, before the answer
        assert sum(bool(r) for r in reasoning) > 1
        last_reasoning = max(i for i, r in enumerate(reasoning) if r)
        assert last_reasoning < min(i for i, c in enumerate(content) if c)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_document_request_honours_the_template_variables(client):
    for extra, reasoning in ((THINK, REASONING_TEXT), ({}, None)):
        r = chat(client, document=DOC, keep_ratio=0.5, scorer="bm25", **extra)
        msg = r.choices[0].message
        assert (msg.content, msg.model_extra["reasoning_content"]) == (ANSWER_TEXT, reasoning)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokenize": True},
        {"enable_thinking": "yes"},
        {"add_generation_prompt": False},
        {"namespace": 1},  # shadows a function Qwen3's template calls
    ],
)
@pytest.mark.parametrize("document", [None, DOC])
def test_bad_template_variables_are_422_naming_the_field(server, kwargs, document):
    body = {"model": MODEL, "messages": MSGS, "chat_template_kwargs": kwargs}
    if document:
        body.update(document=document, scorer="bm25")
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


QA = {"document": DOC, "question": "Is 7 odd?", "keep_ratio": 0.5, "scorer": "bm25"}


def test_qa_returns_the_exact_prompt_on_request(server):
    r = httpx.post(server.url + "/qa", json={**QA, "return_prompt": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["answer"] == ANSWER_TEXT
    prompt = body["prompt"]
    assert prompt.startswith("<|im_start|>user\nRead the document below")
    assert prompt.endswith("Question: Is 7 odd?\nAnswer:<|im_end|>\n" + EMPTY_THINK)
    assert "prompt" not in body["compression"]
    assert body["usage"]["prompt_tokens"] == body["compression"]["kept_tokens"]
    plain = httpx.post(server.url + "/qa", json=QA, timeout=60).json()
    assert "prompt" not in plain and plain["answer"] == ANSWER_TEXT


def test_qa_stream_returns_the_prompt_with_the_final_event(server):
    events = []
    body = {**QA, "return_prompt": True, "stream": True}
    with httpx.stream("POST", server.url + "/qa", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    first, done = events[0], events[-1]
    assert first["type"] == "compression" and "prompt" not in first["compression"]
    assert done["type"] == "done" and done["prompt"].endswith(EMPTY_THINK)
