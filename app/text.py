"""Token ids to text, incrementally, with OpenAI ``stop`` strings.

Streaming clients must never see text that is later withdrawn. :class:`TextStream` decodes the
whole id list at each push (answers are short; this keeps multi-token characters and
tokenizer spacing right), holds back a trailing replacement character (an incomplete UTF-8
sequence) and any tail that could still grow into a stop string, and on a stop string cuts the
text before it and reports ``stopped``. Ids in ``hidden`` (a request's ``stop_token_ids``, which
end the answer as EOS does) never reach the text, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Incremental detokeniser with stop strings (see the module docstring)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), hidden: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hidden = set(hidden)
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False

    def _hold(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the text that is now safe to send."""
        if self.stopped:
            return ""
        self.ids += [i for i in ids if i not in self.hidden]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped = True
            self.text = text[: min(cuts)]
            return self._advance(len(self.text))
        self.text = text
        safe = len(text.rstrip("\ufffd"))
        return self._advance(safe - self._hold(text[:safe]))

    def flush(self) -> str:
        """At the end: whatever was held back (a stop prefix that never completed)."""
        return self._advance(len(self.text))

    def _advance(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out
