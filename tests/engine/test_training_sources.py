"""Training data sources: ShareGPT (truncated JSON), teacher-forced text records, the general
prompt sets, the evaluation-set guard, and `d3d train --drafter lora:N` end to end."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from d3d.model.drafter import D3DDrafter
from d3d.training.data import read_many, training_guard
from d3d.training.sources import SHARED_DATA, load_source
from d3d.training.teacher import (
    first_exchange,
    sharegpt_conversations,
    sharegpt_items,
    write_text_records,
)
from tests.conftest import tiny_model, tiny_tokenizer


def _conv(i: int, reply: str = "w5 w6 w7") -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": f"w{i + 1} w2"},
            {"from": "gpt", "value": reply},
        ],
    }


def test_sharegpt_file_is_decoded_record_by_record_up_to_the_truncation(tmp_path):
    whole = json.dumps([_conv(0), _conv(1), _conv(2)], indent=2)
    cut = whole[: whole.index('"c2"') + 20]  # the third record is cut mid-way, as in the wheel
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    convs = list(sharegpt_conversations(path))
    assert [c["id"] for c in convs] == ["c0", "c1"]
    path.write_text(whole)
    assert len(list(sharegpt_conversations(path))) == 3
    items = sharegpt_items(limit=2, path=path)
    assert items == [("sharegpt/c0", "sharegpt", "w1 w2", "w5 w6 w7"),
                     ("sharegpt/c1", "sharegpt", "w2 w2", "w5 w6 w7")]  # fmt: skip


def test_first_exchange_needs_a_human_turn_and_its_reply():
    assert first_exchange(_conv(0)) == ("w1 w2", "w5 w6 w7")
    assert first_exchange({"conversations": [{"from": "gpt", "value": "x"}]}) is None
    assert first_exchange(_conv(0, reply=" ")) is None


class _ChatTokenizer:
    """The tiny word tokenizer with a trivial chat template (what encode_prompt needs)."""

    def __init__(self):
        self.tok = tiny_tokenizer()

    def __call__(self, text, add_special_tokens=False):
        return self.tok(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **_):
        return self.tok(" ".join(m["content"] for m in messages), add_special_tokens=False)[
            "input_ids"
        ]


def test_teacher_forced_records_resume_and_cut_replies(tmp_path):
    items = [("a", "sharegpt", "w1 w2", "w5 w6 w7 w8 w9"), ("b", "sharegpt", "w3", "w4")]
    out = tmp_path / "tf.jsonl"
    tok = _ChatTokenizer()
    assert write_text_records(tok, items, out, max_reply_tokens=3) == 1  # "b": 1 reply token
    rec = read_many(out)[0]
    assert rec["teacher_forced"] and rec["response_ids"] == [5, 6, 7]
    assert rec["prompt_ids"] == [1, 2] and rec["split"] in ("train", "heldout")
    assert write_text_records(tok, items, out) == 0  # resumed: nothing new


def test_evaluation_sets_are_kept_out_of_training():
    rows = [{"id": "a", "source": "general_prompts.jsonl"}, {"id": "b", "source": "gsm8k"}]
    with pytest.raises(ValueError, match="gsm8k"):
        training_guard(rows)
    assert len(training_guard(rows, allow_eval=True)) == 2
    assert len(training_guard(rows[:1])) == 1


@pytest.mark.skipif(
    not (SHARED_DATA / "general_prompts").is_dir(), reason="needs ../shared/data/general_prompts"
)
def test_general_prompt_sets_use_the_ids_of_the_shared_responses():
    prompts = load_source("general@3")
    assert [p.id for p in prompts] == [f"general_prompts.jsonl/{i}" for i in range(3)]
    assert load_source("general2@1")[0].id == "general_prompts_2.jsonl/0"
    shared = SHARED_DATA / "target_responses" / "smollm2_general.jsonl.gz"
    if shared.is_file():
        first = next(r for r in read_many(shared) if r["id"] == "general_prompts.jsonl/17")
        assert first["prompt"] == load_source("general@18")[17].text


def test_train_command_with_an_adapter_drafter(tmp_path, capsys):
    from d3d.cli import main

    model = tiny_model("llama", seed=0, layers=2)
    model.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    data = tmp_path / "data.jsonl"
    rows = [{"id": f"r{i}", "source": "t", "split": "train", "prompt": "p",
             "prompt_ids": [1, 2, 3], "response_ids": [5 + i, 7, 9, 11, 7, 9, 11, 13] * 3}
            for i in range(4)]  # fmt: skip
    rows.append({**rows[0], "id": "tf", "teacher_forced": True})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", "--target", str(tmp_path / "target"), "--drafter", "lora:2:4",
            "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "3",
            "--grad-accum", "2", "--val-seqs", "1", "--max-len", "24", "--anchors", "3",
            "--kl-weight", "0.5", "--topk", "4", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 3 and report["loss"] is not None
    final = tmp_path / "run" / "final"
    stored = load_file(str(final / "drafter.safetensors"))
    assert not any(k.startswith("lm.") for k in stored)
    back = D3DDrafter.load(final, model)
    assert back.adapters is not None and back.meta.adapter["rank"] == 4
    assert float(back.adapters.lora["1__mlp__down_proj"].B.detach().abs().sum()) > 0  # trained
    ids = [1, 2, 3, 5]
    assert int(back.session().draft(ids).tokens[0]) == int(
        model(torch.tensor([ids])).logits[0, -1].argmax()
    )


def test_generated_data_keeps_the_targets_top_k_and_pack_aligns_it(tmp_path):
    from d3d.engine import Engine
    from d3d.model.load import LoadedModel
    from d3d.training.objectives import pack
    from d3d.training.responses import DataConfig, generate_data
    from d3d.training.sources import Prompt
    from tests.engine.test_training import CharTokenizer

    class Tok(CharTokenizer):
        pad_token_id = 0

    model = tiny_model("llama", seed=4, scale=3.0)
    target = LoadedModel(model, Tok(), "tiny")
    out = tmp_path / "d.jsonl"
    cfg = DataConfig(max_new_tokens=12, batch_size=2, topk=3)
    prompts = [Prompt("a", "t", "hello"), Prompt("b", "t", "hi there")]
    assert generate_data(Engine(target), prompts, out, cfg, progress=False).written == 2
    for rec in read_many(out):
        resp, ids, logp = rec["response_ids"], rec["topk_ids"], rec["topk_logprobs"]
        assert len(ids) == len(resp) and len(ids[0]) == 3
        assert [row[0] for row in ids] == resp  # greedy: the top-1 is the emitted token
        assert all(a >= b for row in logp for a, b in itertools.pairwise(row))
        g = torch.Generator().manual_seed(0)
        pk = pack(rec["prompt_ids"], resp, 4, 4, g, max_len=len(rec["prompt_ids"]) + 6,
                  topk=(ids, logp))  # fmt: skip
        labels, soft_ids = pk.block_labels, pk.soft[0]
        has = labels != -100
        assert torch.equal(soft_ids[..., 0][has], labels[has])
