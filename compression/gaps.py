"""Gap markers: the kept context as the document's kept runs in order, marked where text was cut.

Selection keeps context token indices. Read back to back, two kept runs run into each other
("... to get mentioned in Notice anything missing? ...") and a reader cannot tell a cut from
continuous text. The kept context is therefore its *runs* (maximal stretches of consecutive kept
tokens, :func:`runs`) in document order with a marker wherever text was dropped: between two
runs, before the first run when it does not open the document, and after the last when it does
not close it. Nothing is marked where nothing was cut, so

- keep ratio 1.0 (one run, the whole document) gives the context unchanged, and
- the head every question keeps (``Compressed.head``, a run that opens the document) has no
  marker before it: the shared prefix (instruction and head) is the same tokens with or without
  markers, and the marker after the head is the first token of the question's own part.

Markers (``CompressionConfig.gap``, ``--gap``): ``ellipsis`` " ... " (the default), ``newline``
"\\n", ``none`` (runs joined with nothing, the prompt as it was before markers). A marker's edge
spaces are left out where the token beside it has whitespace on that side already: kept runs
mostly open with a word's leading space, so two runs read "... is 4817. ... The" and the marker
tokenises as it would in running text (" ..." then " The"). Each variant is encoded once.
"""

from __future__ import annotations

from collections.abc import Sequence

from compression.prompt import PromptParts, Tokenizer, encode_text

GAPS = {"ellipsis": " ... ", "newline": "\n", "none": ""}


def runs(kept: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of consecutive indices in ascending ``kept``."""
    out: list[list[int]] = []
    for i in kept:
        if out and i == out[-1][1]:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


def _trim(text: str, spaced_before: bool, spaced_after: bool) -> str:
    text = text.lstrip(" ") if spaced_before else text
    return text.rstrip(" ") if spaced_after else text


class GapMarker:
    """Joins a context's kept runs with the marker ``GAPS[name]`` (see the module docstring)."""

    def __init__(self, name: str, tokenizer: Tokenizer | None = None):
        if name not in GAPS:
            raise ValueError(f"gap must be one of {', '.join(GAPS)}, got {name!r}")
        text = GAPS[name]
        if text and tokenizer is None:
            raise ValueError(f"gap {name!r} needs a tokenizer (gap 'none' does not)")
        self.name = name
        self.tokenizer = tokenizer
        # (whitespace before it already, whitespace after it already) -> the marker's ids
        self._ids = {
            (b, a): tuple(encode_text(tokenizer, _trim(text, b, a))) if text else ()
            for b in (False, True)
            for a in (False, True)
        }

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if ids else ""  # type: ignore[union-attr]

    def ids(self, before: Sequence[int], after: Sequence[int]) -> tuple[int, ...]:
        """The marker between token ``before`` and token ``after`` (one id each; none: the
        prompt's edge, which needs no space)."""
        spaced_before = not before or self._text(before)[-1:].isspace()
        spaced_after = not after or self._text(after)[:1].isspace()
        return self._ids[(spaced_before, spaced_after)]

    def join(self, parts: PromptParts, kept: Sequence[int]) -> list[int]:
        """The kept context: ``parts.context`` at ``kept`` (ascending), a marker at each gap."""
        ctx = parts.context
        if self.name == "none":
            return [ctx[i] for i in kept]
        out: list[int] = []
        end = 0  # where the last run ended; the document's start before the first run
        for a, b in runs(kept):
            if a > end:
                out += self.ids(out[-1:] or parts.prefix[-1:], ctx[a : a + 1])
            out += ctx[a:b]
            end = b
        if end < len(ctx):
            out += self.ids(out[-1:] or parts.prefix[-1:], parts.suffix[:1])
        return out
