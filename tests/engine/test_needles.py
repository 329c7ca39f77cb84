"""The needle family: one-sentence facts of several lengths and wordings at several depths of
real essays, placed so that fixed 32-token chunk boundaries cross them.

Fast tests use a word-level tokenizer (a token per word or punctuation mark, leading space
kept, as byte-level BPE does) and a tiny random drafter: at keep 0.1 the default compressor
(hybrid scorer, sentence-packed units) keeps every needle sentence whole, where fixed chunks cut
some. The slow test runs ``d3d qa --keep 0.2`` with the embedded target on a ~4k-token essay
holding all the needles, one ``--question`` each, and checks every answer; and ``d3d compress
--keep 0.1`` keeps every needle whole with the real tokenizer and reader.
"""

from __future__ import annotations

import json
import re

import pytest

from compression.compressor import DEFAULT_SCORER, CompressionConfig, Compressor
from compression.drafter_scorers import AttentionScoring
from compression.prompt import build_parts
from compression.qa import QA_TEMPLATE
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model

# (needle sentence, question, answer): short and long facts, names, numbers, places, and
# questions worded close to the fact or around it.
NEEDLES = (
    ("The secret code for the Lisbon archive is 4817.",
     "What is the secret code for the Lisbon archive?", "4817"),
    ("Marta's favourite fruit is the purple mangosteen.",
     "Which fruit does Marta like best?", "mangosteen"),
    ("The lighthouse keeper's dog, a scruffy terrier that once swam across the harbour "
     "to fetch a lost oar, is named Biscuit.",
     "What is the name of the lighthouse keeper's dog?", "Biscuit"),
    ("Professor Okafor's lucky number is 7392.",
     "What is Professor Okafor's lucky number?", "7392"),
    ("The museum's oldest clock was built in Prague.",
     "In which city was the museum's oldest clock built?", "Prague"),
    ("The spare key to the studio is kept inside a blue teapot on the top shelf.",
     "Where is the spare key to the studio kept?", "teapot"),
)  # fmt: skip
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
TOKEN = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


class WordTokenizer:
    """One token per word or punctuation mark (leading whitespace kept), ids assigned on first
    sight; decode is exact concatenation."""

    chat_template = None
    bos_token_id = None
    eos_token_id = 0

    def __init__(self):
        self.vocab: dict[str, int] = {"<eos>": 0}
        self.texts: list[str] = ["<eos>"]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = []
        for piece in TOKEN.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.texts)
                self.texts.append(piece)
            ids.append(self.vocab[piece])
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.texts[int(i)] for i in ids if int(i) > 0)

    def batch_decode(self, batch) -> list[str]:
        return [self.decode(ids) for ids in batch]


def essays(n_words: int) -> list[str]:
    """Sentences of the shared essays, about ``n_words`` words in all (skip when absent)."""
    from eval.longbench.offline import DATA_DIR, essay_paragraphs

    if not (DATA_DIR / "paul_graham_essays").is_dir():
        pytest.skip("the shared essays are not here")
    out, words = [], 0
    for para in essay_paragraphs(sentences=1):
        out.append(para)
        words += len(para.split())
        if words >= n_words:
            return out
    return out


def crossing_document(tokenize, sentences: list[str], needle: str, depth: float, chunk: int = 32):
    """Sentences with ``needle`` inserted near ``depth``, padded so a multiple of ``chunk``
    tokens falls strictly inside the needle's tokens. Returns the text."""
    at = round(depth * len(sentences))
    head = " ".join(sentences[:at])
    for pad in range(chunk):
        pre = head + " " + " ".join(["well"] * pad) if pad else head
        start = len(tokenize(pre + " "))
        end = start + len(tokenize(needle))
        if start // chunk != (end - 1) // chunk and start % chunk:
            return pre + " " + needle + " " + " ".join(sentences[at:])
    raise AssertionError("no padding makes a chunk boundary cross the needle")


def kept_whole(kept_text: str, needle: str) -> bool:
    return needle in kept_text


@pytest.fixture(scope="module")
def haystack() -> list[str]:
    return essays(3000)  # about 3.5k word tokens


def test_default_compressor_keeps_every_needle_whole_where_fixed_chunks_cut_some(haystack):
    tok = WordTokenizer()
    count = lambda text: tok(text)["input_ids"]  # noqa: E731
    docs = [
        (crossing_document(count, haystack, needle, depth), needle, question)
        for needle, question, _ in NEEDLES
        for depth in DEPTHS
    ]
    for text, _, question in docs:  # fill the vocabulary before sizing the tiny model
        build_parts(tok, QA_TEMPLATE, text, input=question)
    target = tiny_model("llama", seed=0, vocab=len(tok.texts) + 1, layers=2, window=8192)
    drafter = D3DDrafter.from_target(target, 2)
    default = CompressionConfig(attention=AttentionScoring())  # the default scorer, packed units
    assert default.scorer == DEFAULT_SCORER and default.granularity == "packed"
    hybrid = Compressor.build(default, tok, drafter, target)
    chunked = Compressor.build(CompressionConfig("bm25", granularity="chunk"), tok)
    cut = 0
    for text, needle, question in docs:
        parts = build_parts(tok, QA_TEMPLATE, text, input=question)
        assert len(parts.context) > 3000
        out = hybrid.compress(parts, 0.1)
        assert len(out.kept) <= round(0.1 * len(parts.context))
        assert kept_whole(tok.decode(out.parts.context), needle), (needle, question)
        cut += not kept_whole(tok.decode(chunked.compress(parts, 0.1).parts.context), needle)
    assert cut > 0  # the family does cut needles at fixed chunk boundaries


@pytest.mark.slow
def test_qa_answers_every_needle_at_keep_02_and_keeps_them_whole_at_01(haystack, tmp_path, capsys):
    from d3d.cli import main
    from d3d.model.load import load_target

    tok = load_target("default").tokenizer
    count = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    text = " ".join(haystack)
    for k, (needle, _, _) in enumerate(NEEDLES):  # one needle per depth band, boundary-crossing
        sentences = re.split(r"(?<=[.!?])\s+", text)
        text = crossing_document(count, sentences, needle, (k + 0.5) / len(NEEDLES))
    assert 3800 < len(count(text)) < 6000
    doc = tmp_path / "essay.txt"
    doc.write_text(text)
    asks = [arg for _, q, _ in NEEDLES for arg in ("--question", q)]
    common = ["--document", str(doc), *asks, "--json", "--threads", "1"]
    assert main(["compress", *common, "--keep", "0.1"]) == 0
    kept = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for (needle, _, _), row in zip(NEEDLES, kept, strict=True):
        assert needle in row["kept_text"], needle
        assert row["compression"]["scorer"] == "drafter-match"  # what auto is for this pair
    assert main(["qa", *common, "--keep", "0.2", "--max-new-tokens", "24"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for (_, question, answer), row in zip(NEEDLES, rows, strict=True):
        assert row["question"] == question
        assert answer.lower() in row["answer"].lower(), (question, row["answer"])
    # the document is read once: every later question finds the reader's pass in the cache
    assert [r["compression"]["document_cached"] for r in rows] == [False] + [True] * (len(rows) - 1)
    t = rows[-1]["timings"]
    assert t["total_s"] == pytest.approx(
        t["tokenize_s"] + t["compress_s"] + t["prefill_s"] + t["decode_s"], abs=1e-3
    )
