"""A second /qa question about the same document reuses the target's work on the instruction
and the document's head (the batched engine's prefix cache), and answers exactly as the first
time. Live server on a tiny random model."""

from __future__ import annotations

import httpx

from tests.api.conftest import tiny_server

DOC = " ".join(f"w{3 + (7 * i) % 90}" for i in range(300))
QA = {"document": DOC, "max_new_tokens": 5, "scorer": "bm25", "keep_ratio": 0.5}


def ask_full(srv, question: str) -> dict:
    body = {**QA, "question": question, "keep_ratio": 1.0}
    return httpx.post(srv.url + "/qa", json=body, timeout=60).json()


def test_second_question_takes_the_head_from_the_prefix_cache():
    srv = tiny_server()

    def ask(question: str) -> httpx.Response:
        return httpx.post(srv.url + "/qa", json={**QA, "question": question}, timeout=60)

    try:
        first = ask("w10 w17 w24").json()
        head = first["compression"]["head_tokens"]
        assert head > 0 and first["speculative"]["cached_prompt_tokens"] == 0
        second = ask("w31 w38").json()
        again = ask("w10 w17 w24").json()
        cached = second["speculative"]["cached_prompt_tokens"]
        assert cached > head  # the instruction and the document's head
        assert again["speculative"]["cached_prompt_tokens"] == cached
        assert again["answer"] == first["answer"]
        assert srv.worker.batch.prefix_cache.stats()["hits"] == 2
        # Keep 1.0 cuts nothing: a second question reuses the instruction and the whole document.
        full = [ask_full(srv, q) for q in ("w10 w17 w24", "w31 w38")]
        shared = full[0]["compression"]["head_tokens"]
        assert shared == full[0]["compression"]["context_tokens"]
        assert [f["speculative"]["cached_prompt_tokens"] for f in full] == [
            0,
            cached - head + shared,
        ]
    finally:
        srv.stop()
