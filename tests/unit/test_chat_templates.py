"""One door into chat templates (:func:`d3d.model.load.apply_chat`): every prompt the project builds
is non-thinking on the real Qwen3 template, thinking only when asked, and templates without the
variable still work."""

from __future__ import annotations

import copy

import pytest

from compression.prompt import build_parts
from compression.qa import QA_TEMPLATE
from d3d.model.load import apply_chat, check_template_vars, encode_messages, encode_prompt
from d3d.training.data import read_many
from d3d.training.teacher import write_text_records
from tests.conftest import THINK_END_ID, THINK_START_ID

EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_non_thinking_by_default_and_thinking_when_asked(qwen3_tokenizer):
    text = apply_chat(qwen3_tokenizer, MSGS)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n" + EMPTY_THINK)
    thinking = apply_chat(qwen3_tokenizer, MSGS, enable_thinking=True)
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking


def test_encoded_messages_are_what_the_tokenizer_itself_encodes(qwen3_tokenizer):
    for thinking in (False, True):
        ours = encode_messages(qwen3_tokenizer, MSGS, enable_thinking=thinking)
        theirs = qwen3_tokenizer.apply_chat_template(
            MSGS, add_generation_prompt=True, tokenize=True, enable_thinking=thinking
        )
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert ours == list(theirs)
    ids = encode_prompt(qwen3_tokenizer, "Hi there")
    assert ids[-4:] == [THINK_START_ID, 271, THINK_END_ID, 271]  # <think>\n\n</think>\n\n


def test_a_template_without_the_variable_still_renders(qwen3_tokenizer):
    plain = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    tok = copy.deepcopy(qwen3_tokenizer)
    tok.chat_template = plain
    assert apply_chat(tok, MSGS) == "[system] Be brief.\n[user] Hi there\n[assistant] "
    assert apply_chat(tok, MSGS, enable_thinking=True) == apply_chat(tok, MSGS)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat(tok, MSGS)
    assert encode_prompt(tok, "Hi") == tok("Hi")["input_ids"]  # raw text, no template


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"tokenize": True}, "'tokenize' is not a chat template variable"),
        ({"messages": []}, "'messages' is not a chat template variable"),
        ({"not a name": 1}, "is not a chat template variable"),
        ({"enable_thinking": "yes"}, "enable_thinking must be true or false"),
    ],
)
def test_request_variables_that_are_not_template_variables_are_refused(variables, message):
    with pytest.raises(ValueError, match=message):
        check_template_vars(variables)


def test_qa_prompt_parts_are_non_thinking(qwen3_tokenizer):
    parts = build_parts(qwen3_tokenizer, QA_TEMPLATE, "A long document.", input="Why?")
    assert qwen3_tokenizer.decode(parts.prefix).startswith("<|im_start|>user\nRead the document")
    assert qwen3_tokenizer.decode(parts.context) == "A long document."
    suffix = qwen3_tokenizer.decode(parts.suffix)
    assert suffix.endswith("Question: Why?\nAnswer:<|im_end|>\n" + EMPTY_THINK)
    thinking = build_parts(
        qwen3_tokenizer, QA_TEMPLATE, "doc", template_vars={"enable_thinking": True}, input="q"
    )
    assert qwen3_tokenizer.decode(thinking.suffix).endswith("<|im_start|>assistant\n")


def test_teacher_forced_training_prompts_are_non_thinking(qwen3_tokenizer, tmp_path):
    out = tmp_path / "tf.jsonl"
    items = [("a", "sharegpt", "Say hi.", "Hi! How can I help you today?")]
    assert write_text_records(qwen3_tokenizer, items, out) == 1
    rec = read_many(out)[0]
    assert qwen3_tokenizer.decode(rec["prompt_ids"]).endswith("Say hi.<|im_end|>\n" + EMPTY_THINK)
