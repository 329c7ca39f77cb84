"""Token ids to text, incrementally, with OpenAI ``stop`` strings.

Streaming clients must never see text that is later withdrawn. :class:`TextStream` holds back a
trailing replacement character (an incomplete UTF-8 sequence) and any tail that could still grow
into a stop string, and on a stop string cuts the text before it and reports ``stopped``. Ids in
``hidden`` (a request's ``stop_token_ids``, which end the answer as EOS does) never reach the
text, as in vLLM.

Each push costs the new ids, not the answer so far (an answer of 4,096 tokens pushed one at a
time must not decode 4,096 growing lists on the event loop). The text splits at a *settled* id:
``ids[:base]`` ends on a whole character, and its text never changes again. A push decodes only
``ids[ctx:]`` (``ctx``: the previous settled id, as context, so spacing and multi-byte characters
across the join come out as a decode of the whole list would) and takes what ``ids[base:]``
adds; stop strings are searched in that text plus the last ``longest stop - 1`` characters
before it (an earlier stop would already have ended the answer). The chunks are those a decode
of the whole list at every push would send (``tests/unit/test_text_stream.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Sequence

FFFD = "\ufffd"
CHAR_IDS = 4  # a character spans at most 4 byte-level tokens


class TextStream:
    """Incremental detokeniser with stop strings (see the module docstring)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), hidden: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.keep = max((len(s) for s in self.stop), default=1) - 1  # chars a stop can straddle
        self.hidden = set(hidden)
        self.ids: list[int] = []
        self.ctx = self.base = 0  # ids[ctx:base]: decode context; ids[:base]: settled text
        self.before = ""  # the settled text's last `keep` characters
        self.local = ""  # before + the text of ids[base:]
        self.sent = 0  # characters of `local` already sent (may be < len(before): held back)
        self.parts: list[str] = []  # what was sent
        self.stopped = False

    @property
    def text(self) -> str:
        """The answer so far: sent text, plus what is held back unless a stop string cut it."""
        return "".join(self.parts) + ("" if self.stopped else self.local[self.sent :])

    def _hold(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the text that is now safe to send."""
        if self.stopped:
            return ""
        self.ids += [i for i in ids if i not in self.hidden]
        head = len(self._decode(self.ids[self.ctx : self.base]))
        new = self._decode(self.ids[self.ctx :])[head:]  # the text of ids[base:]
        self.local = self.before + new
        cuts = [i for i in (self.local.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped = True
            return self._advance(min(cuts))
        safe = len(self.local.rstrip(FFFD))
        out = self._advance(safe - self._hold(self.local[:safe]))
        self._settle(*self._whole(head, new))
        return out

    def _whole(self, head: int, new: str) -> tuple[int, int]:
        """The last id that ends a whole character, and the length of the text of
        ``ids[base:it]``: all of it unless the text ends mid-character (U+FFFD)."""
        n = len(self.ids)
        if not new.endswith(FFFD):
            return n, len(new)
        for end in range(n - 1, max(self.base, n - 1 - CHAR_IDS), -1):
            part = self._decode(self.ids[self.ctx : end])[head:]
            if not part.endswith(FFFD) and new.startswith(part):
                return end, len(part)
        if n - self.base > 4 * CHAR_IDS:  # invalid bytes, not a character still coming
            end = n - CHAR_IDS
            return end, len(self._decode(self.ids[self.ctx : end])[head:])
        return self.base, 0

    def _settle(self, end: int, chars: int) -> None:
        """``ids[:end]`` (``chars`` characters past ``base``) is settled: later pushes decode
        after it, with the id before as context."""
        if end <= self.base:  # nothing new: ctx stays below base, the join's context
            return
        self.ctx, self.base = self.base, end
        settled = len(self.before) + chars
        cut = min(self.sent, max(0, settled - self.keep))  # keep what is unsent
        self.before, self.local = self.local[cut:settled], self.local[cut:]
        self.sent -= cut

    def flush(self) -> str:
        """At the end: whatever was held back (a stop prefix that never completed)."""
        return "" if self.stopped else self._advance(len(self.local))

    def _advance(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.local[self.sent : upto]
        self.sent = upto
        self.parts.append(out)
        return out
