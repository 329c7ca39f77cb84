"""A prompt split into the parts compression treats differently.

``PromptParts`` holds token ids in three runs: ``prefix`` (chat header and the instruction before
the document), ``context`` (the document: the only part that is ever cut) and ``suffix`` (the
question, the instruction tail and the assistant header). The full prompt is their concatenation,
so keep ratio 1.0 reproduces it exactly and every compressed prompt differs only by the context
tokens it drops.

The parts are tokenised separately. A template with a ``{context}`` field is rendered (through the
chat template when asked, non-thinking unless told: :func:`d3d.model.load.apply_chat`) with a marker
in place of the document, split at the marker, and each piece tokenised on its own; token
boundaries at the two seams can differ from tokenising the whole string, identically at every
keep ratio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from d3d.model.load import apply_chat, has_chat_template

CONTEXT_MARKER = "\u0000D3D_CONTEXT\u0000"


class Tokenizer(Protocol):
    """What compression needs from a tokenizer (a Hugging Face one fits)."""

    def __call__(self, text: str, add_special_tokens: bool = ...) -> dict: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class PromptParts:
    """Token ids of a prompt as prefix + context + suffix (see the module docstring)."""

    prefix: tuple[int, ...]
    context: tuple[int, ...]
    suffix: tuple[int, ...]
    question: tuple[int, ...] = ()  # the question alone (inside the suffix), for scorers

    def __post_init__(self) -> None:
        if not self.suffix:
            raise ValueError("a prompt needs a non-empty suffix (the question)")

    @property
    def ids(self) -> list[int]:
        return [*self.prefix, *self.context, *self.suffix]

    def __len__(self) -> int:
        return len(self.prefix) + len(self.context) + len(self.suffix)

    def with_context(self, context: Sequence[int]) -> PromptParts:
        return PromptParts(self.prefix, tuple(context), self.suffix, self.question)


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a piece of text, without BOS/EOS (special-token text is still parsed)."""
    if not text:
        return []
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def render(
    template: str,
    chat_template: bool,
    tokenizer: Tokenizer,
    template_vars: Mapping[str, object] | None = None,
    **fields: str,
) -> str:
    """Fill ``template`` (``str.format`` fields) and wrap it as one user turn when asked, through
    :func:`d3d.model.load.apply_chat` (non-thinking unless ``template_vars`` say otherwise)."""
    text = template.format(**fields)
    if chat_template and has_chat_template(tokenizer):
        msgs = [{"role": "user", "content": text}]
        text = apply_chat(tokenizer, msgs, **(template_vars or {}))  # type: ignore[arg-type]
    return text


def build_parts(
    tokenizer: Tokenizer,
    template: str,
    context: str,
    chat_template: bool = True,
    template_vars: Mapping[str, object] | None = None,
    question_field: str = "input",
    **fields: str,
) -> PromptParts:
    """Tokenise ``template`` filled with ``context`` and ``fields`` into prefix/context/suffix.

    ``template_vars``: further chat-template variables (e.g. ``enable_thinking``). The field
    ``question_field`` (when given) is also tokenised alone, as the parts' ``question``."""
    if "{context}" not in template:
        raise ValueError("the prompt template has no {context} field")
    text = render(
        template, chat_template, tokenizer, template_vars, context=CONTEXT_MARKER, **fields
    )
    head, _, tail = text.partition(CONTEXT_MARKER)
    prefix = encode_text(tokenizer, head)
    if not chat_template or not has_chat_template(tokenizer):
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and getattr(tokenizer, "add_bos_token", False):
            prefix = [int(bos), *prefix]
    asked = fields.get(question_field, "").strip()  # as it follows "Question:" in a prompt
    question = encode_text(tokenizer, " " + asked) if asked else []
    return PromptParts(
        tuple(prefix),
        tuple(encode_text(tokenizer, context)),
        tuple(encode_text(tokenizer, tail)),
        tuple(question),
    )


def middle_truncate(parts: PromptParts, max_length: int) -> PromptParts:
    """LongBench's rule: over ``max_length`` tokens, keep the first and last halves.

    The cut falls inside the context whenever prefix and suffix each fit in half the window,
    which holds for every LongBench template; otherwise this raises rather than cut the question.
    """
    if len(parts) <= max_length:
        return parts
    half = max_length // 2
    head = half - len(parts.prefix)
    tail = max_length - half - len(parts.suffix)
    if head < 0 or tail < 0:
        raise ValueError(
            f"max_length {max_length} cannot hold the prompt's instruction and question "
            f"({len(parts.prefix)} + {len(parts.suffix)} tokens)"
        )
    ctx = parts.context
    return parts.with_context(ctx[:head] + (ctx[len(ctx) - tail :] if tail else ()))
