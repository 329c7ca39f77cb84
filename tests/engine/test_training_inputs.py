"""``d3d train`` on bad or small input: a small file trains (its validation split shrunk, and a
log line says so); every other cause is one ``d3d: error:`` line (exit 2) naming the file, the
cause and what fixes it. A tiny Llama target with a word-level tokenizer (``w0 .. w95``)."""

import gzip
import json

import pytest

from d3d.cli import main
from tests.conftest import tiny_model, tiny_tokenizer

VOCAB = 96


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "target"
    tiny_model("llama", seed=0, vocab=VOCAB, layers=2, tie=True).save_pretrained(path)
    tiny_tokenizer(VOCAB).save_pretrained(path)
    return path


def record(i: int, response: list[int], split: str = "train", text: str | None = None) -> dict:
    return {"id": f"r{i}", "source": "t", "split": split, "prompt": "p", "prompt_ids": [1, 2, 3],
            "response_ids": response,
            "text": " ".join(f"w{t}" for t in response) if text is None else text}  # fmt: skip


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def eight(n_tokens: int = 24, **kw) -> list[dict]:
    """Eight records of ``n_tokens`` response tokens (the size `d3d data --prompts` of a short
    prompt file writes)."""
    return [record(i, [(5 + i + 3 * j) % 90 + 2 for j in range(n_tokens)], **kw) for i in range(8)]


def train(capsys, target_dir, data: str, out, *extra: str) -> tuple[int, str, str]:
    """Exit code, stderr and stdout of `d3d train` (two steps, tiny windows)."""
    args = ["train", "--target", str(target_dir), "--drafter", "self:1", "--data", data,
            "--out", str(out), "--steps", "2", "--grad-accum", "1", "--max-len", "16",
            "--anchors", "2", "--threads", "1", "--quiet", *extra]  # fmt: skip
    code = main(args)
    seen = capsys.readouterr()
    return code, seen.err, seen.out


def one_error_line(code: int, err: str, out: str = "") -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("d3d: error: "), err
    return lines[0]


def test_eight_records_train_with_a_shrunk_validation_split(capsys, caplog, tmp_path, target_dir):
    data = write(tmp_path / "d.jsonl", eight())
    caplog.set_level("WARNING")
    code, err, out = train(capsys, target_dir, data, tmp_path / "run")
    assert code == 0, err
    assert "8 training records: setting 2 aside for validation instead of 12" in caplog.text
    assert "--val-seqs" in caplog.text
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert any("val_acceptance_length" in r for r in rows)  # the 2 set aside validate


def test_an_explicit_split_that_leaves_nothing_names_the_flag(capsys, tmp_path, target_dir):
    data = write(tmp_path / "d.jsonl", eight())
    line = one_error_line(*train(capsys, target_dir, data, tmp_path / "run", "--val-seqs", "8"))
    assert f"{data}: --val-seqs 8 sets aside all 8 training records" in line
    assert "pass --val-seqs 2" in line
    assert not (tmp_path / "run").exists()  # refused before anything loads or is written


def test_records_too_short_say_how_many_and_the_minimum(capsys, tmp_path, target_dir):
    data = write(tmp_path / "d.jsonl", eight(n_tokens=1))
    line = one_error_line(*train(capsys, target_dir, data, tmp_path / "run"))
    assert "all 8 training records are too short" in line
    assert "needs 2 response tokens or more, the longest has 1" in line
    assert "--max-new-tokens" in line


def test_short_records_among_good_ones_are_skipped(capsys, caplog, tmp_path, target_dir):
    data = write(tmp_path / "d.jsonl", [*eight(), record(9, [7])])
    caplog.set_level("WARNING")
    code, err, _ = train(capsys, target_dir, data, tmp_path / "run", "--val-seqs", "1")
    assert code == 0, err
    assert "skipping 1 of 9 training records with fewer than 2 response tokens" in caplog.text


def test_ids_past_the_targets_vocabulary_mean_another_tokenizer(capsys, tmp_path, target_dir):
    recs = eight()
    recs[3]["response_ids"][5] = 500  # a Qwen3 or SmolLM2 id: far past this target's 96
    data = write(tmp_path / "d.jsonl", recs)
    line = one_error_line(*train(capsys, target_dir, data, tmp_path / "run"))
    assert "token id 500 is outside the target's vocabulary (96 ids" in line
    assert f"d3d data --target {target_dir}" in line


def test_stored_text_the_target_does_not_decode_means_another_tokenizer(
    capsys, tmp_path, target_dir
):
    data = write(tmp_path / "d.jsonl", eight(text="Hello! How can I help you today?"))
    line = one_error_line(*train(capsys, target_dir, data, tmp_path / "run"))
    assert "made with another tokenizer" in line and "in 8 of 8 records checked" in line


def test_text_differing_only_in_spaces_is_the_same_tokenizer(capsys, tmp_path, target_dir):
    recs = [record(i, r["response_ids"], text="  " + r["text"].replace(" ", "\n") + " ")
            for i, r in enumerate(eight())]  # fmt: skip
    code, err, _ = train(capsys, target_dir, write(tmp_path / "d.jsonl", recs), tmp_path / "run")
    assert code == 0, err


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", b"", "no records (the file is empty)"),
        ("blank.jsonl", b"\n\n", "no records (the file is empty)"),
        ("text.jsonl", b"hello world\n", "line 1 is not JSON"),
        ("binary.jsonl", b"\xff\xfe\x00\x01", "not a text file"),
        ("fake.jsonl.gz", b'{"id": 1}\n', "cannot read it (Not a gzipped file"),
        ("prompts.jsonl", b'{"prompt": "hi"}\n', "record 1 is not a `d3d data` record"),
    ],
)
def test_unreadable_files_are_one_line(capsys, tmp_path, target_dir, name, content, message):
    (tmp_path / name).write_bytes(content)
    line = one_error_line(*train(capsys, target_dir, str(tmp_path / name), tmp_path / "run"))
    assert f"{tmp_path / name}: {message}" in line


def test_a_gzipped_data_file_cut_short_is_one_line(capsys, tmp_path, target_dir):
    blob = gzip.compress("".join(json.dumps(r) + "\n" for r in eight()).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(blob[: len(blob) // 2])
    line = one_error_line(*train(capsys, target_dir, str(tmp_path / "cut.jsonl.gz"), tmp_path))
    assert "cannot read it" in line


def test_a_missing_file_and_a_held_out_only_file(capsys, tmp_path, target_dir):
    line = one_error_line(*train(capsys, target_dir, str(tmp_path / "nope.jsonl"), tmp_path))
    assert "data file not found" in line
    data = write(tmp_path / "h.jsonl", eight(split="heldout"))
    line = one_error_line(*train(capsys, target_dir, data, tmp_path / "run"))
    assert "no training records (all 8 are in the held-out split)" in line
