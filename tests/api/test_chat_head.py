"""A chat's head (its system turn and the next turn's opening) is read once into the prefix
cache and copied by later chats with the same system turn; an answer is the same whether its head
was cached or not. The head's ids (:func:`app.prompts.chat_head`) on the real Qwen3 template and
on a template that writes a default system turn; the served chats on a random Qwen3 with the real
tokenizer, through the OpenAI SDK (``usage.prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from app.prompts import HEAD_MIN, chat_head, head_length
from d3d.model.load import encode_messages
from tests.api.conftest import folder_server
from tests.conftest import tiny_tokenizer

MODEL = "qwen3-tiny"
SYSTEM = "You are a careful assistant. Answer in one short sentence and never use lists."


def test_head_is_the_system_turn_every_such_chat_starts_with(qwen3_tokenizer):
    tok = qwen3_tokenizer
    sys_msg = {"role": "system", "content": SYSTEM}
    head = chat_head(tok, [sys_msg, {"role": "user", "content": "x"}])
    assert len(head) >= HEAD_MIN
    assert SYSTEM in tok.decode(head)
    for text in ("What is 2 + 2?", "Name a river.", "\n\nlong\n" * 30):
        msgs = [sys_msg, {"role": "user", "content": text}]
        ids = encode_messages(tok, msgs)
        n = head_length(tok, msgs, ids)
        assert ids[:n] == head[:n] and len(ids) > n
        # A user turn led by newlines merges them with the turn's opening "\n": one less.
        assert n == len(head) - text.startswith("\n")
    other = chat_head(tok, [{"role": "system", "content": "Be terse."}])
    assert other != head and other[:3] == head[:3]
    # Qwen3's template writes no system turn of its own: a bare chat's head is a few tokens.
    assert len(chat_head(tok, [{"role": "user", "content": "hi"}])) < HEAD_MIN


def test_a_template_s_default_system_turn_is_part_of_the_head():
    tok = tiny_tokenizer()
    default = " ".join(f"w{i}" for i in range(1, 19))
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}" + default + " {% endif %}"
        "{% for m in messages %}w19 {{ m['content'] }} w20 {% endfor %}"
        "{% if add_generation_prompt %}w21{% endif %}"
    )

    def head(msgs):
        ids = encode_messages(tok, msgs)
        return tok.decode(ids[: head_length(tok, msgs, ids)]).split()

    assert head([{"role": "user", "content": "w40 w41"}]) == [*default.split(), "w19"]
    assert (
        head([{"role": "system", "content": "w30 w31"}, {"role": "user", "content": "w40"}]) == []
    )
    system = " ".join(f"w{i}" for i in range(50, 70))
    long = head([{"role": "system", "content": system}, {"role": "user", "content": "w40"}])
    assert long == ["w19", *system.split(), "w20", "w19"]


@pytest.fixture(scope="module")
def client(qwen3_dir):
    srv = folder_server(qwen3_dir, MODEL)
    yield OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), srv
    srv.stop()


def ask(client, user: str, system: str | None = SYSTEM, mode: str = "ar"):
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    out = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "speculative": {"mode": mode}},
    )
    return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens


def test_chats_share_their_head_and_answer_as_if_alone(client, qwen3_tokenizer):
    client, srv = client
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    head = head_length(qwen3_tokenizer, msgs, encode_messages(qwen3_tokenizer, msgs))
    assert head >= HEAD_MIN
    first, cached = ask(client, "Tell me about rivers in spring.")
    assert cached == 0  # nothing cached yet: it read its head and kept it
    _, cached = ask(client, "What is the capital of France?", mode="sync")
    assert cached == head
    again, cached = ask(client, "Tell me about rivers in spring.")
    assert cached == head and again == first
    assert srv.worker.batch.prefix_cache.stats()["hits"] >= 2
    # Without a system turn Qwen3's head is too short to be worth a step: nothing is cached.
    assert ask(client, "Tell me about rivers in spring.", system=None)[1] == 0
