"""The official OpenAI SDK against a live server with the real default model."""

from __future__ import annotations

import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_is_the_same_in_every_mode(client):
    answers, stats = {}, {}
    for mode in ("ar", "sync", "auto"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=24,
            temperature=0,
            extra_body={"speculative": {"mode": mode}},
        )
        answers[mode] = r.choices[0].message.content
        stats[mode] = r.model_extra["speculative"]
        assert r.usage.completion_tokens > 0
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.choices[0].finish_reason in ("stop", "length")
    assert answers["ar"] == answers["sync"] == answers["auto"]
    assert "paris" in answers["ar"].lower()
    assert stats["sync"]["num_drafts"] > 0 and stats["ar"]["num_drafts"] == 0
    for key in (
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "accepted_per_position",
        "acceptance_length",
    ):
        assert key in stats["sync"]


def test_chat_stream_with_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [full.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_completions_and_stream(client):
    prompt = "The three primary colours are"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    assert r.choices[0].text and r.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True)
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_stop_strings_cut_the_text(client):
    base = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=16)
    text = base.choices[0].text
    stop = text.strip()[2:4] or text[1:3]
    r = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=16, stop=[stop])
    assert stop not in r.choices[0].text
    assert text.startswith(r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=7,
    )
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_document_and_keep_ratio_through_extra_body(client):
    doc = "The Eiffel tower is in Paris. It was completed in 1889. " + "Bananas are yellow. " * 40
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "When was the Eiffel tower completed?"}],
        max_tokens=12,
        extra_body={"document": doc, "keep_ratio": 0.3, "scorer": "bm25"},
    )
    comp = r.model_extra["compression"]
    assert comp["scorer"] == "bm25" and comp["kept_context_tokens"] < comp["context_tokens"]
    assert comp["kept_spans"] and r.choices[0].message.content


def test_concurrent_greedy_answers_equal_the_same_requests_alone(client):
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["Name a colour.", "What is 2 + 2?", "Say hi to Bob.", "Name a river.", "Spell cat."]

    def ask(p: str) -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=12
        )
        return r.choices[0].message.content

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone
