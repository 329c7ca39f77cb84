"""The commands on a Qwen3 made like Qwen3-8B (real tokenizer and template, untied head, 151,936
embedding rows; hidden 64, 2 layers), loaded with ``--target <folder>``: every prompt they build
is non-thinking, ``d3d qa --json`` reports the exact prompt, and bf16 runs on a CPU."""

from __future__ import annotations

import json

import pytest
import torch

from compression.prompt import build_parts
from compression.qa import QA_TEMPLATE
from d3d.cli import main
from d3d.model.load import encode_prompt, load_target
from d3d.training.data import read_many
from tests.conftest import ANSWER_TEXT, QWEN3_EOS, QWEN3_VOCAB, greedy_continuation

EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
PROMPT = "Name a prime number."


def run(capsys, *args: str) -> dict:
    assert main(list(args)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def generate(capsys, target, *flags: str) -> dict:
    return run(capsys, "generate", PROMPT, "--target", str(target), "--json", "--fresh-costs",
               "--threads", "1", "--max-new-tokens", "8", *flags)  # fmt: skip


def test_the_model_is_made_like_qwen3_8b(qwen3_dir):
    loaded = load_target(str(qwen3_dir))
    model = loaded.model
    assert loaded.vocab_size == QWEN3_VOCAB > len(loaded.tokenizer)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert not model.config.tie_word_embeddings and model.config.num_hidden_layers == 2
    assert QWEN3_EOS in loaded.eos_token_ids


def test_generate_reads_the_non_thinking_prompt_and_speculation_is_lossless(capsys, qwen3_dir):
    ar = generate(capsys, qwen3_dir, "--mode", "ar")
    loaded = load_target(str(qwen3_dir))
    ids = encode_prompt(loaded.tokenizer, PROMPT)
    assert loaded.tokenizer.decode(ids).endswith(f"{PROMPT}<|im_end|>\n{EMPTY_THINK}")
    want = greedy_continuation(loaded.model, ids, 8)
    assert ar["token_ids"] == want[: len(ar["token_ids"])] and ar["num_tokens"] > 0
    sync = generate(capsys, qwen3_dir, "--mode", "sync", "--drafter", "self:1")
    assert sync["token_ids"] == ar["token_ids"] and sync["num_drafts"] > 0


@pytest.mark.parametrize("mode", ["ar", "sync"])
def test_bfloat16_on_a_cpu(capsys, scripted_qwen3_dir, mode):
    out = generate(capsys, scripted_qwen3_dir, "--dtype", "bfloat16", "--mode", mode,
                   "--drafter", "self:1")  # fmt: skip
    assert out["text"] == ANSWER_TEXT  # the non-thinking prompt: the answer, no think block
    assert out["token_ids"][-1] == QWEN3_EOS
    assert load_target(str(scripted_qwen3_dir), dtype="bfloat16").model.dtype == torch.bfloat16


def test_qa_json_reports_the_exact_non_thinking_prompt(capsys, qwen3_dir, tmp_path):
    text = " ".join(f"Fact {i}: {i} is {'odd' if i % 2 else 'even'}." for i in range(60))
    doc = tmp_path / "doc.txt"
    doc.write_text(text)
    question = "Is 7 odd?"
    out = run(capsys, "qa", "--document", str(doc), "--question", question, "--target",
              str(qwen3_dir), "--keep", "0.5", "--mode", "ar", "--max-new-tokens", "4",
              "--fresh-costs", "--threads", "1", "--json")  # fmt: skip
    prompt = out["prompt"]
    assert prompt.startswith("<|im_start|>user\nRead the document below")
    assert prompt.endswith(f"Question: {question}\nAnswer:<|im_end|>\n{EMPTY_THINK}")
    # The prompt's parts are tokenised apart (compression.prompt), so the text is their ids
    # decoded: the instruction, the kept half of the document, the question.
    tok = load_target(str(qwen3_dir)).tokenizer
    parts = build_parts(tok, QA_TEMPLATE, text, input=question)
    head, tail = tok.decode(parts.prefix), tok.decode(parts.suffix)
    assert prompt.startswith(head) and prompt.endswith(tail)
    kept = prompt[len(head) : len(prompt) - len(tail)]
    assert 0 < len(kept) < 0.7 * len(text)
    assert all(f in text for f in kept.split(".")[1:-1])  # whole facts, in the document


def test_data_prompts_are_non_thinking(capsys, qwen3_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Say hi.", "Count to 3.")))
    out = tmp_path / "data.jsonl"
    report = run(capsys, "data", "--out", str(out), "--sources", f"jsonl:{prompts}", "--target",
                 str(qwen3_dir), "--max-new-tokens", "4", "--batch-size", "2", "--threads", "1")  # fmt: skip
    assert report["written"] == 2
    tok = load_target(str(qwen3_dir)).tokenizer
    for rec in read_many(out):
        assert tok.decode(rec["prompt_ids"]).endswith(f"{rec['prompt']}<|im_end|>\n{EMPTY_THINK}")
        assert 0 < len(rec["response_ids"]) <= 4
