"""LongBench prompts as prefix / context / suffix token runs, and answer post-processing.

The official procedure: fill the task's template from ``dataset2prompt.json``; middle-truncate to
the model's window (first and last halves of the tokens); wrap in the chat template except for
trec / triviaqa / samsum / lsht / lcc / repobench-p; decode greedily for the task's
``dataset2maxlen.json`` tokens. LongBench truncates the raw prompt and then applies the chat
template; here the chat template's few header tokens are counted inside the window, so the cut
is a few tokens deeper, and always inside the context.
"""

from __future__ import annotations

from compression.prompt import PromptParts, Tokenizer, build_parts, middle_truncate
from eval.longbench.data import Item, max_new_tokens, prompt_template, uses_chat_template

SAFETY_TOKENS = 16


def window_budget(window: int, item: Item, block_size: int = 16) -> int:
    """Prompt tokens allowed for ``item``: the window minus its answer and one draft block."""
    return window - max_new_tokens(item) - block_size - SAFETY_TOKENS


def item_parts(item: Item, tokenizer: Tokenizer, max_length: int) -> PromptParts:
    """The item's prompt, split and middle-truncated to ``max_length`` tokens."""
    parts = build_parts(
        tokenizer,
        prompt_template(item),
        item.context,
        chat_template=uses_chat_template(item),
        input=item.input,
    )
    return middle_truncate(parts, max_length)
