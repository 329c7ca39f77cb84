"""A chat answer's thinking apart from its answer: vLLM's reasoning-parser convention.

Qwen3 (and models that copy its tags) thinks inside ``<think>`` ... ``</think>`` before it
answers. As vLLM's reasoning parser does, the chat route returns that text as
``message.reasoning_content`` (streaming: ``delta.reasoning_content``) and only the rest as
``content``, so the tags never reach the answer. The split works on text, after stop strings:

- ``<think>`` opens reasoning, ``</think>`` closes it; the tags themselves are never emitted (a
  stray one is dropped), so ``content`` holds no tag whatever the model does.
- A prompt that ends inside an open think block (templates that write ``<think>`` into the
  generation prompt) starts in reasoning. Qwen3's non-thinking prompt closes an empty block
  itself, so its answer is all content.
- Newlines are trimmed as Qwen3's template trims them when it reads a turn back: around the
  reasoning, and at the head of the answer after ``</think>``.
- Streaming never sends text it would later withdraw: a tail that could still grow into a tag,
  and reasoning's trailing newlines, wait for the next piece. Pushing a text whole or in any
  pieces gives the same reasoning and content (the non-streaming answer is one push).

The parser is on only for tokenizers that hold both tags as single tokens (Qwen3's do, ids
151667 / 151668, not special tokens, so detokenising keeps them); elsewhere a chat answer
is all content, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
TAGS = (THINK_START, THINK_END)


@dataclass(frozen=True)
class Split:
    """Text for the two channels; either may be empty."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


def _partial_tag(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a tag."""
    for n in range(min(len(text), max(map(len, TAGS)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in TAGS):
            return n
    return 0


class ReasoningSplitter:
    """Incremental split of an answer into reasoning and content (see the module docstring)."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking  # inside a think block
        self._lstrip = thinking  # drop the newlines that open the current segment
        self._held = ""  # reasoning's trailing newlines, sent only if more reasoning follows
        self._buf = ""  # text not yet judged (a possible tag's head)

    def push(self, text: str) -> Split:
        """Add answer text; return what is now safe to send on each channel."""
        self._buf += text
        out = Split()
        while True:
            at = [(i, tag) for tag in TAGS if (i := self._buf.find(tag)) >= 0]
            if not at:
                break
            i, tag = min(at)
            out += self._emit(self._buf[:i], ends=True)
            self._buf = self._buf[i + len(tag) :]
            opened = tag == THINK_START
            if opened != self.thinking:  # a stray tag (no state change) only disappears
                self.thinking, self._lstrip = opened, True
        keep = _partial_tag(self._buf)
        out += self._emit(self._buf[: len(self._buf) - keep], ends=False)
        self._buf = self._buf[len(self._buf) - keep :]
        return out

    def flush(self) -> Split:
        """At the end of the answer: whatever was held back."""
        text, self._buf = self._buf, ""
        return self._emit(text, ends=True)

    def _emit(self, text: str, ends: bool) -> Split:
        if self._lstrip:
            text = text.lstrip("\n")
            self._lstrip = not text
        if not self.thinking:
            return Split(content=text)
        text, self._held = self._held + text, ""
        body = text.rstrip("\n")
        if not ends:
            self._held = text[len(body) :]
        return Split(reasoning=body)


def split_reasoning(text: str, thinking: bool = False) -> Split:
    """A whole answer split at once (the same result as pushing it in pieces)."""
    splitter = ReasoningSplitter(thinking)
    return splitter.push(text) + splitter.flush()


def has_reasoning_tags(tokenizer) -> bool:
    """Whether ``tokenizer`` holds both think tags as single tokens (a reasoning model's)."""
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in TAGS]
    return None not in ids and tokenizer.convert_ids_to_tokens(ids) == list(TAGS)


def splitter_for(tokenizer, prompt_ids: Sequence[int]) -> ReasoningSplitter | None:
    """The splitter for an answer to ``prompt_ids``, or None where the model has no think tags.

    It starts inside a think block when the prompt ends with an open ``<think>``.
    """
    if not has_reasoning_tags(tokenizer):
        return None
    tail = tokenizer.decode(list(prompt_ids[-4:]), skip_special_tokens=False)
    return ReasoningSplitter(thinking=tail.rstrip().endswith(THINK_START))
