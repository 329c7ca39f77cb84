"""``d3d data`` through the engine on the tiny Qwen3 made like Qwen3-8B: a batch writes the records
one request at a time writes (rows join as others finish), shards partition the prompts, a rerun
resumes (a torn last line dropped), and prompts found in an evaluation set are refused unless
asked for — and then refused by training."""

from __future__ import annotations

import json

import pytest

from d3d.engine import Engine
from d3d.model.load import load_target
from d3d.training import contamination
from d3d.training.contamination import EvalIndex
from d3d.training.data import data_files, read_many, training_guard
from d3d.training.responses import DataConfig, Shard, done_ids, generate_data
from d3d.training.sources import Prompt, load_source
from tests.engine.test_drafters_any_target import data_args, run

WORDS = ["the", "river", "runs", "past", "old", "stone", "walls", "and", "quiet", "fields",
         "toward", "the", "distant", "grey", "sea"]  # fmt: skip


def mixed_prompts(n: int = 10) -> list[Prompt]:
    """Prompts of mixed lengths (a few words to a paragraph)."""
    out = []
    for i in range(n):
        body = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + 11 * (i % 4)))
        out.append(Prompt(f"p/{i}", "mixed", f"Continue: {body}"))
    return out


@pytest.fixture(scope="module")
def engine(qwen3_dir) -> Engine:
    return Engine(load_target(str(qwen3_dir)))


def responses(path) -> dict[str, list[int]]:
    return {r["id"]: r["response_ids"] for r in read_many(path)}


def test_a_batch_writes_what_one_at_a_time_writes(engine, tmp_path, monkeypatch):
    prompts = mixed_prompts()
    cfg = DataConfig(max_new_tokens=16, heldout_fraction=0.0)
    one = generate_data(engine, prompts, tmp_path / "one.jsonl",
                        DataConfig(**{**cfg.__dict__, "batch_size": 1}), progress=False)  # fmt: skip
    sched, widths = engine.scheduler(), []
    step = sched.step
    monkeypatch.setattr(sched, "step", lambda: (widths.append(len(sched.rows)), step()))
    many = generate_data(engine, prompts, tmp_path / "many.jsonl",
                         DataConfig(**{**cfg.__dict__, "batch_size": 4}), progress=False)  # fmt: skip
    assert max(widths) == 4  # rows decoded together (and joined as others finished)
    assert one.written == many.written == len(prompts)
    assert responses(tmp_path / "many.jsonl") == responses(tmp_path / "one.jsonl")
    lengths = {len(r) for r in responses(tmp_path / "one.jsonl").values()}
    assert many.response_tokens == one.response_tokens and lengths


def test_shards_partition_the_prompts_and_reruns_resume(engine, tmp_path):
    prompts = mixed_prompts(8)
    cfg = DataConfig(max_new_tokens=6, heldout_fraction=0.0, batch_size=3)
    out = tmp_path / "d.jsonl"
    reports = [
        generate_data(engine, prompts, out, cfg, Shard(i, 2), progress=False) for i in (0, 1)
    ]
    files = data_files(out)
    assert [f.name for f in files] == ["d.shard-0-of-2.jsonl", "d.shard-1-of-2.jsonl"]
    ids = [set(responses(f)) for f in files]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == {p.id for p in prompts}
    assert sum(r.written for r in reports) == len(prompts) and all(r.written for r in reports)
    # A rerun of the whole set writes nothing new; a torn last line is dropped and redone.
    assert generate_data(engine, prompts, out, cfg, progress=False).written == 0
    lines = files[0].read_text().splitlines(keepends=True)
    files[0].write_text("".join(lines[:-1]) + lines[-1][:25])
    assert len(done_ids(out)) == len(prompts) - 1
    again = generate_data(engine, prompts, out, cfg, progress=False)
    assert again.written == 1 and again.skipped_done == len(prompts) - 1
    assert set(responses(out)) == {p.id for p in prompts}  # the file and its shards


def test_torchrun_ranks_are_shards(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert Shard.parse(None) == Shard(3, 4)
    assert Shard.parse("1/2") == Shard(1, 2)
    with pytest.raises(ValueError, match="shard"):
        Shard.parse("2/2")


GSM8K_ITEM = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?"
)


def test_prompts_found_in_an_evaluation_set_are_refused(capsys, monkeypatch, tmp_path, qwen3_dir):
    index = EvalIndex([("gsm8k", f"{GSM8K_ITEM}\nSolve this step by step.")])
    monkeypatch.setattr(contamination, "default_index", lambda: index)
    prompts = tmp_path / "p.jsonl"
    copied = f"Question:\n{GSM8K_ITEM.upper()}  Think carefully."  # reformatted, still the item
    rows = [{"prompt": copied}, {"prompt": "How many clips did you sell in May?"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run(capsys, *data_args(qwen3_dir, prompts, tmp_path / "a.jsonl"))
    assert report["written"] == 1 and report["refused_eval"] == 1
    assert report["eval_sets_checked"] == ["gsm8k"]
    report = run(capsys, *data_args(qwen3_dir, prompts, tmp_path / "b.jsonl",
                                    "--allow-eval-sources"))  # fmt: skip
    assert report["written"] == 2
    records = read_many(tmp_path / "b.jsonl")
    assert [r.get("eval_set") for r in records].count("gsm8k") == 1
    with pytest.raises(ValueError, match="gsm8k"):
        training_guard(records)
    assert len(training_guard(records, allow_eval=True)) == 2


def test_prompt_files_take_prompts_chats_and_lines(tmp_path):
    path = tmp_path / "mix.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}]  # fmt: skip
    rows = [json.dumps({"prompt": "A"}), json.dumps({"id": "x", "source": "s", "messages": chat})]
    path.write_text("\n".join([*rows, "plain line"]) + "\n")
    a, b, c = load_source(f"jsonl:{path}")
    assert (a.id, a.source, a.text, a.messages) == ("mix.jsonl/0", "mix.jsonl", "A", None)
    assert (b.id, b.source, b.text) == ("x", "s", "Hi") and len(b.messages) == 2
    assert c.text == "plain line"
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "?"}]}) + "\n")
    with pytest.raises(ValueError, match="user turn"):
        load_source(f"jsonl:{path}")
