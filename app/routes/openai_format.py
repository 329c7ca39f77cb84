"""OpenAI's response shapes for chat and text completions: choices, stream chunks, logprobs.

:class:`Shape` turns a finished :class:`~app.generation.Outcome` into a response's ``choices``
and each :class:`~app.generation.Delta` of a stream into chunks, ``index`` naming the choice
(``n`` > 1). A chat stream's first chunk for a choice carries ``role: assistant`` and leaves
with the choice's first token (vLLM's way), never before the prompt is read: clients time the
first token by it. Thinking comes apart from the answer per choice (:mod:`app.reasoning`).

Logprobs (:class:`~d3d.sampling.TokenLogprob`: of the target's processed distribution,
see :func:`~d3d.sampling.log_distribution`) take OpenAI's two shapes: chat
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``, completions
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``. Spelling
every alternative is the costly part (up to ``n x max_tokens x (1 + top)`` tokens): each token is
decoded once per response, and the routes call a :class:`Shape` that renders logprobs on the
thread pool, off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.generation import Choice, Delta
from app.reasoning import ReasoningSplitter
from d3d.sampling import TokenLogprob


class Shape:
    """One response's formatting (see the module docstring): ``chat`` or text completion,
    ``logprobs`` asked for, the tokenizer that spells tokens, the choices' reasoning splitters
    (None where the model has no think tags)."""

    def __init__(
        self,
        chat: bool,
        tokenizer,
        logprobs: bool,
        splitters: Sequence[ReasoningSplitter | None],
    ):
        self.chat, self.tokenizer, self.logprobs = chat, tokenizer, logprobs
        self.splitters = list(splitters)
        self.offsets = [0] * len(self.splitters)  # completions: text offset of the next token
        self.spelt: dict[int, str] = {}  # alternatives repeat: each token is decoded once

    # -- logprobs ----------------------------------------------------------------------------
    def _spell(self, token: int) -> str:
        if (text := self.spelt.get(token)) is None:
            text = self.spelt[token] = self.tokenizer.decode([token])
        return text

    def _logprobs(self, i: int, lps: Sequence[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in lps]}
        tokens = [self._spell(lp.token) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._spell(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def _chat_entry(self, lp: TokenLogprob) -> dict:
        def one(token: int, logprob: float) -> dict:
            text = self._spell(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}

    # -- a whole response ----------------------------------------------------------------------
    def choices(self, choices: Sequence[Choice]) -> list[dict]:
        return [self._choice(c) for c in choices]

    def _choice(self, c: Choice) -> dict:
        out: dict = {"index": c.index, "finish_reason": c.finish_reason}
        out["logprobs"] = self._logprobs(c.index, c.logprobs)
        if not self.chat:
            out["text"] = c.text
            return out
        out["message"] = {"role": "assistant", "content": c.text}
        if (splitter := self.splitters[c.index]) is not None:
            split = splitter.push(c.text) + splitter.flush()
            out["message"]["content"] = split.content
            out["message"]["reasoning_content"] = split.reasoning or None
        return out

    # -- a stream ------------------------------------------------------------------------------
    def chunks(self, d: Delta) -> list[dict]:
        """The ``choices`` entries one delta sends (each becomes one chunk)."""
        logprobs = self._logprobs(d.index, d.logprobs) if d.logprobs else None
        if not self.chat:
            if not (d.text or d.first or d.finish or logprobs):
                return []
            return [
                {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish}
            ]
        content, thinking = d.text, ""
        if (splitter := self.splitters[d.index]) is not None:
            split = splitter.push(d.text)
            if d.finish:
                split += splitter.flush()
            content, thinking = split.content, split.reasoning
        out = []
        if d.first or content or thinking or logprobs:
            delta: dict = {"role": "assistant"} if d.first else {}
            if thinking:
                delta["reasoning_content"] = thinking
            if content or d.first:
                delta["content"] = content
            out.append(
                {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            )
        if d.finish:
            out.append({"index": d.index, "delta": {}, "logprobs": None, "finish_reason": d.finish})
        return out
