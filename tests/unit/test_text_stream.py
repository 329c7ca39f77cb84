"""The incremental detokeniser (:mod:`app.text`) against the naive one it replaced: a decode of
the whole answer and a scan of every stop string at every push. On real byte-level tokens
(multi-byte characters split across pushes, random ids that are invalid UTF-8) and the tiny word
tokenizer, in every chunking, with and without stop strings and hidden ids, it sends the same
chunks, stops at the same place and ends with the same text."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from app.text import TextStream
from tests.conftest import tiny_tokenizer


class NaiveStream:
    """The old TextStream: the whole id list decoded and every stop scanned at each push."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), hidden: Sequence[int] = ()):
        self.tokenizer, self.stop, self.hidden = tokenizer, [s for s in stop if s], set(hidden)
        self.ids: list[int] = []
        self.sent, self.text, self.stopped = 0, "", False

    def _hold(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.ids += [i for i in ids if i not in self.hidden]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped = True
            self.text = text[: min(cuts)]
            return self._advance(len(self.text))
        self.text = text
        safe = len(text.rstrip("\ufffd"))
        return self._advance(safe - self._hold(text[:safe]))

    def flush(self) -> str:
        return self._advance(len(self.text))

    def _advance(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out


def run(stream, ids: Sequence[int], sizes: Sequence[int]) -> tuple[list[str], str, bool]:
    chunks, i = [], 0
    for n in sizes:
        chunks.append(stream.push(ids[i : i + n]))
        i += n
    chunks.append(stream.push(ids[i:]))
    chunks.append(stream.flush())
    return chunks, stream.text, stream.stopped


def chunkings(n: int, rng: random.Random, count: int = 12):
    yield [1] * n
    yield [n]
    for _ in range(count):
        sizes, left = [], n
        while left > 0:
            sizes.append(rng.randint(1, min(9, left)))
            left -= sizes[-1]
        yield sizes


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from d3d.model.load import embedded_default_dir

    folder = embedded_default_dir()
    if not (folder / "tokenizer.json").exists():
        pytest.skip("the embedded model is not converted here")
    return AutoTokenizer.from_pretrained(str(folder))


TEXTS = [
    "The answer is 42. It was found in chapter three, after the storm.",
    "中文字符和表情 😀🎉 mixed with English — and «quotes»; café, naïve.\n\nNew paragraph.",
    "STOP here? No: the stop is END and then more text END again.",
]
STOPS = [(), ("END",), ("chapter", "storm."), ("表情",), ("\n\n", "é"), ("xyz" * 20,)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", STOPS)
def test_same_chunks_as_naive_on_real_tokens(smol, text, stop):
    ids = smol(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(len(text) + len(stop))
    for sizes in chunkings(len(ids), rng):
        assert run(TextStream(smol, stop), ids, sizes) == run(NaiveStream(smol, stop), ids, sizes)


def test_invalid_bytes_and_hidden_ids(smol):
    """Random ids (bytes that are no UTF-8), special and hidden ids: still the naive chunks."""
    rng = random.Random(7)
    for trial in range(20):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randint(5, 60))]
        ids[rng.randrange(len(ids))] = smol.eos_token_id
        hidden = [ids[rng.randrange(len(ids))]] if trial % 2 else []
        stop = ("a",) if trial % 3 == 0 else ()
        for sizes in chunkings(len(ids), rng, count=4):
            new = run(TextStream(smol, stop, hidden), ids, sizes)
            assert new == run(NaiveStream(smol, stop, hidden), ids, sizes)


def test_word_tokenizer():
    tok = tiny_tokenizer()
    ids = [5, 17, 3, 99, 42, 42, 8, 100, 7]
    rng = random.Random(1)
    for stop in [(), ("w42 w8",), ("w3",)]:
        for sizes in chunkings(len(ids), rng):
            new = run(TextStream(tok, stop, [100]), ids, sizes)
            assert new == run(NaiveStream(tok, stop, [100]), ids, sizes)


class CountingTokenizer:
    """Records how many ids each decode is given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_push_decodes_only_the_new_ids(smol):
    """A long answer pushed a token at a time never decodes the whole answer again."""
    ids = smol(TEXTS[1] * 20, add_special_tokens=False)["input_ids"]
    tok = CountingTokenizer(smol)
    stream = TextStream(tok, ("never there",))
    for i in ids:
        stream.push([i])
    assert len(ids) > 300 and max(tok.sizes) <= 16
