"""``d3d compress`` / ``d3d qa``: bad input is one line on stderr and exit code 2 (no model load),
and the needle demo on the embedded default (slow)."""

from __future__ import annotations

import argparse
import json

import pytest

from compression.cli import add_compression_args, compression_config
from d3d.cli import main


@pytest.fixture
def doc(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text("Some text. " * 20)
    return p


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda d: ["--document", str(d.parent / "missing.txt")], "document not found"),
        (lambda d: ["--document", str(d), "--keep", "0"], "keep ratio must be in (0, 1]"),
        (lambda d: ["--document", str(d), "--keep", "1.5"], "keep ratio must be in (0, 1]"),
        (lambda d: ["--document", str(d), "--scorer", "magic"], "unknown scorer 'magic'"),
        (lambda d: ["--document", str(d), "--score-heads", "7-7"], "--score-heads"),
    ],
)
@pytest.mark.parametrize("command", ["qa", "compress"])
def test_bad_input_is_exit_2_with_one_line(command, make_args, message, doc, capsys):
    assert main([command, "--question", "why?", *make_args(doc)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("d3d: error:") and message in err
    assert len(err.splitlines()) == 1


def test_empty_document_is_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["qa", "--document", str(empty), "--question", "q"]) == 2
    assert "document is empty" in capsys.readouterr().err


def test_gap_flag_reaches_the_config():
    p = argparse.ArgumentParser()
    add_compression_args(p)
    assert compression_config(p.parse_args([]), "default").gap == "ellipsis"
    assert compression_config(p.parse_args(["--gap", "newline"]), "default").gap == "newline"
    with pytest.raises(SystemExit):
        p.parse_args(["--gap", "dots"])
    assert not compression_config(p.parse_args([]), "default").question_int8
    assert compression_config(p.parse_args(["--question-int8"]), "default").question_int8


@pytest.mark.slow
def test_qa_keeps_the_needle_and_answers_with_it(tmp_path, capsys):
    from eval.longbench.offline import essay_paragraphs

    paras = essay_paragraphs()[:60]
    needle = "The secret code for the Lisbon archive is 4817."
    paras.insert(25, needle)
    essay = tmp_path / "essay.txt"
    essay.write_text("\n\n".join(paras))
    question = "What is the secret code for the Lisbon archive?"
    args = ["qa", "--document", str(essay), "--question", question, "--keep", "0.1"]
    assert main([*args, "--json", "--threads", "1", "--max-new-tokens", "24"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "4817" in out["answer"]
    c = out["compression"]
    assert c["scorer"] == "drafter-match" and c["kept_tokens"] < 0.2 * c["total_tokens"]
    assert set(out["timings"]) >= {"compress_s", "prefill_s", "decode_s", "total_s"}
    assert "num_drafts" in json.dumps(out["speculative"])
