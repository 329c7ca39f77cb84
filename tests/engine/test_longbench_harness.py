"""The LongBench harness end to end on two tiny items with a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from compression.compressor import CompressionConfig
from compression.drafter_scorers import AttentionScoring
from d3d.cli import main
from d3d.engine import Engine
from d3d.model.drafter import D3DDrafter
from d3d.model.load import LoadedModel
from eval.longbench.data import Item, load_local, take_per_dataset
from eval.longbench.prompts import item_parts
from eval.longbench.report import write_report
from eval.longbench.runner import RECORDS, Sweep, SweepConfig, read_records, schedule
from tests.unit.test_compression import CharTokenizer

TEMPLATE = "Read: {context}\nQuestion: {input}\nAnswer:"


def tiny_engine() -> Engine:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=0,
        bos_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    drafter = D3DDrafter.from_target(model, 1)
    return Engine(LoadedModel(model, CharTokenizer(), "tiny"), drafter)


def tiny_items() -> list[Item]:
    common = dict(template=TEMPLATE, max_new_tokens=6, metric="qa_f1_score")
    return [
        Item("a", "toy_qa", "who?", "alice met bob. " * 12, ("bob",), **common),
        Item("b", "toy_qa", "where?", "the key is in the box. " * 10, ("box",), **common),
    ]


def sweep_config() -> SweepConfig:
    att = AttentionScoring(layers=2, reader="target", heads=((1, 0),), lookahead=False)
    return SweepConfig(
        keep_ratios=(1.0, 0.5, 0.2),
        modes=("ar", "sync"),
        compression=CompressionConfig(chunk_size=8, attention=att),
    )


def test_schedule_runs_full_and_smallest_first():
    assert schedule(SweepConfig(keep_ratios=(1.0, 0.5, 0.2, 0.1))) == [[1.0, 0.1], [0.2], [0.5]]
    assert schedule(SweepConfig(keep_ratios=(0.5,))) == [[0.5]]
    with pytest.raises(ValueError):
        SweepConfig(keep_ratios=(0.0,))
    with pytest.raises(ValueError):
        SweepConfig(scorers=("nope",))


def test_sweep_end_to_end_resumable_with_report(tmp_path):
    engine = tiny_engine()
    items = tiny_items()
    sweep = Sweep(engine, sweep_config(), tmp_path / "run")
    n = sweep.run(items)
    # per item and mode: full once, then 5 scorers x 2 compressed keep ratios
    assert n == 2 * 2 * (1 + 5 * 2)
    records = read_records(tmp_path / "run" / RECORDS)
    assert len(records) == n
    for r in records:
        assert 0.0 <= r["score"] <= 1.0
        stages = ("tokenize_s", "compress_s", "prefill_s", "decode_s")
        assert r["total_s"] == pytest.approx(sum(r[k] for k in stages), abs=1e-3)
        if r["scorer"] == "full":
            assert r["kept_tokens"] == r["total_tokens"] and r["compress_s"] == 0
        else:
            assert r["kept_tokens"] < r["total_tokens"]
    # lossless: speculative decoding gives the same answer as plain decoding
    by = {(r["item"], r["scorer"], r["keep_ratio"], r["mode"]): r["prediction"] for r in records}
    for (item, scorer, keep, mode), text in by.items():
        if mode == "sync":
            assert text == by[(item, scorer, keep, "ar")]
    # a second run finds everything done
    assert Sweep(engine, sweep_config(), tmp_path / "run").run(items) == 0

    summary = write_report(records, tmp_path / "report", n_boot=50)
    assert summary["n_items"] == 2
    assert {(r["scorer"], r["keep_ratio"]) for r in summary["rows"]} >= {
        ("full", 1.0),
        ("drafter-attention", 0.2),
    }
    for name in ("summary.json", "records.csv", "results.md", "results.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    md = (tmp_path / "report" / "results.md").read_text()
    assert "| drafter-attention | 0.2 | sync | 2 |" in md
    assert "Head to head" in md


def test_report_only_command(tmp_path, capsys):
    rec = {
        "item": "x", "dataset": "toy", "scorer": "full", "keep_ratio": 1.0, "mode": "ar",
        "score": 1.0, "total_tokens": 10, "kept_tokens": 10, "new_tokens": 1, "compress_s": 0.0,
        "prefill_s": 1.0, "decode_s": 1.0, "total_s": 2.0, "evidence_kept": None, "prediction": "p",
    }  # fmt: skip
    small = dict(rec, scorer="random", keep_ratio=0.1, total_s=0.5, score=0.0, evidence_kept=False)
    (tmp_path / RECORDS).write_text(json.dumps(rec) + "\n" + json.dumps(small) + "\n")
    assert main(["eval", "longbench", "--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| random | 0.1 | ar | 1 |" in out and "4.00x" in out
    assert main(["eval", "longbench", "--report-only", "--out", str(tmp_path / "none")]) == 2


def test_longbench_rows_become_prompts_with_truncation(tmp_path):
    rows = [
        {"input": "q?", "context": "c" * 300, "answers": ["a"], "dataset": "qasper", "_id": "1"},
        {"input": "q?", "context": "d" * 50, "answers": ["b"], "dataset": "qasper", "_id": "2"},
        {"input": "q?", "context": "e" * 50, "answers": ["b"], "dataset": "trec", "_id": "3",
         "all_classes": ["x"]},
    ]  # fmt: skip
    (tmp_path / "qasper.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_local(tmp_path, ["qasper", "trec"])
    assert [it.id for it in take_per_dataset(items, 1)] == ["1", "3"]
    parts = item_parts(items[0], CharTokenizer(), 800)
    assert len(parts) == 800  # qasper's long template + 300 chars, cut in the middle
    assert CharTokenizer().decode(parts.suffix).endswith("Question: q?\n\nAnswer:")
    with pytest.raises(FileNotFoundError):
        load_local(tmp_path / "missing")
