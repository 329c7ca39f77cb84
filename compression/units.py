"""Segmenting the context into units: the pieces a scorer ranks and selection keeps or drops.

Pure functions over per-token texts.

- ``chunk``: fixed windows of ``chunk_size`` tokens (SpecPrefill's 32). Cheap, but a sentence
  that straddles a boundary is split, and its halves are scored (and kept) apart.
- ``sentence``: one unit per sentence (or line: code and tables end their units at newlines),
  sentences longer than ``2 x chunk_size`` split into pieces.
- ``packed`` (the default): consecutive sentences packed into units of at most ``chunk_size``
  tokens; a sentence is only cut when it alone exceeds the chunk size. Units are about as even as
  fixed chunks, and a kept unit is whole sentences.

A sentence ends at a token whose text (closing quotes and brackets aside) ends in ``. ! ?`` and
is followed by whitespace, or at a token holding a newline; so ``3.5`` or ``e.g.x`` do not end
one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SENTENCE_END = (".", "!", "?", "。", "！", "？")
CLOSERS = "\"')]}”’»"
GRANULARITIES = ("chunk", "sentence", "packed")


@dataclass(frozen=True)
class Chunk:
    """Context tokens ``[start, end)``."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def fixed_chunks(n: int, size: int) -> list[Chunk]:
    """Consecutive windows of ``size`` tokens covering ``[0, n)`` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [Chunk(s, min(s + size, n)) for s in range(0, n, size)]


def _ends_sentence(text: str, next_text: str | None) -> bool:
    if "\n" in text:
        return True
    core = text.rstrip().rstrip(CLOSERS)
    if not core.endswith(SENTENCE_END):
        return False
    # "3.5", "U.S.A": the next token carries on the word; a sentence needs a space after it.
    return next_text is None or next_text[:1].isspace() or text != text.rstrip()


def _split(c: Chunk, max_len: int) -> list[Chunk]:
    return [Chunk(s, min(s + max_len, c.end)) for s in range(c.start, c.end, max_len)]


def sentence_chunks(token_texts: Sequence[str], max_len: int = 64) -> list[Chunk]:
    """Sentences (or lines) from per-token texts, each at most ``max_len`` tokens."""
    out: list[Chunk] = []
    start, n = 0, len(token_texts)
    for i, text in enumerate(token_texts):
        nxt = token_texts[i + 1] if i + 1 < n else None
        if _ends_sentence(text, nxt):
            out.extend(_split(Chunk(start, i + 1), max_len))
            start = i + 1
    if start < n:
        out.extend(_split(Chunk(start, n), max_len))
    return out


def packed_chunks(token_texts: Sequence[str], size: int = 32) -> list[Chunk]:
    """Whole sentences packed into units of at most ``size`` tokens (long ones cut to size)."""
    out: list[Chunk] = []
    cur: Chunk | None = None
    for s in sentence_chunks(token_texts, max_len=size):
        if cur is not None and len(cur) + len(s) <= size:
            cur = Chunk(cur.start, s.end)
            continue
        if cur is not None:
            out.append(cur)
        cur = s
    if cur is not None:
        out.append(cur)
    return out


def segment(token_texts: Sequence[str], granularity: str, size: int) -> list[Chunk]:
    """Units of the context at ``granularity`` (see the module docstring)."""
    if granularity == "chunk":
        return fixed_chunks(len(token_texts), size)
    if granularity == "sentence":
        return sentence_chunks(token_texts, max_len=2 * size)
    if granularity == "packed":
        return packed_chunks(token_texts, size)
    raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
