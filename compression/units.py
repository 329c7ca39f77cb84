"""Segmenting the context into units: the pieces a scorer ranks and selection keeps or drops.

Pure functions over per-token texts.

- ``chunk``: fixed windows of ``chunk_size`` tokens (SpecPrefill's 32). Cheap, but a sentence
  that straddles a boundary is split, and its halves are scored (and kept) apart.
- ``sentence``: one unit per sentence (or line: code and tables end their units at newlines),
  sentences longer than ``2 x chunk_size`` cut into pieces.
- ``packed`` (the default): consecutive sentences (and pieces of long ones) packed into units of
  at most ``chunk_size`` tokens. Units are about as even as fixed chunks, and a unit is whole
  sentences unless one sentence alone is longer than the size.

A sentence ends at a token whose text (closing quotes and brackets aside) ends in ``. ! ?`` and
is followed by whitespace, or at a token holding a newline; so ``3.5`` or ``e.g.x`` do not end
one.

**Long sentences** (text pasted from a PDF runs clauses together with ", and" for hundreds of
tokens) are cut where a reader would pause, never at a token count: each piece ends at the
furthest cut within the size of the best kind available, in this order: a clause end (a token
ending in ``, ; :`` or a dash, followed by whitespace), before a conjunction or relative word
(" and", " which", " because", ...), between two words (before a token that opens with
whitespace), and only for a single "word" longer than the size (a URL, a hash), anywhere. A
clause that fits the size is therefore never cut, and no cut falls inside a word. No piece is
a sliver (fewer than ``MIN_TOKENS`` tokens or ``MIN_CHARS`` characters): a cut that would
leave one on either side is not taken while another cut is possible.

A piece knows it ends mid-sentence (``Chunk.mid_sentence``: the next unit continues its
sentence), so selection can bring the end of a chosen piece's sentence with it
(:func:`compression.selection.select`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

SENTENCE_END = (".", "!", "?", "。", "！", "？")
CLAUSE_END = (",", ";", ":", "-", "–", "—", "，", "；", "：")
CLOSERS = "\"')]}”’»"
CONJUNCTIONS = frozenset(
    ("and", "but", "or", "nor", "yet", "so", "which", "who", "whom", "whose", "while", "whereas",
     "because", "although", "though", "since", "unless", "until", "when", "where")
)  # fmt: skip
GRANULARITIES = ("chunk", "sentence", "packed")
MIN_TOKENS = 4
MIN_CHARS = 12

# Cut kinds, best first (see the module docstring).
CLAUSE, CONJUNCTION, WORD, ANYWHERE = range(4)


@dataclass(frozen=True)
class Chunk:
    """Context tokens ``[start, end)``; ``mid_sentence``: the next unit continues its sentence."""

    start: int
    end: int
    mid_sentence: bool = False

    def __len__(self) -> int:
        return self.end - self.start


def fixed_chunks(n: int, size: int) -> list[Chunk]:
    """Consecutive windows of ``size`` tokens covering ``[0, n)`` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [Chunk(s, min(s + size, n)) for s in range(0, n, size)]


def max_unit(granularity: str, size: int) -> int:
    """The longest unit ``granularity`` makes at ``size`` tokens."""
    return 2 * size if granularity == "sentence" else size


def _ends_sentence(text: str, next_text: str | None) -> bool:
    if "\n" in text:
        return True
    core = text.rstrip().rstrip(CLOSERS)
    if not core.endswith(SENTENCE_END):
        return False
    # "3.5", "U.S.A": the next token carries on the word; a sentence needs a space after it.
    return next_text is None or next_text[:1].isspace() or text != text.rstrip()


class _Cuts:
    """Where a run of token texts may be cut, and how well (cut ``p``: between ``p-1`` and ``p``)."""

    def __init__(self, texts: Sequence[str]):
        self.texts = texts
        self.chars = [0, *accumulate(len(t) for t in texts)]

    def kind(self, p: int) -> int:
        before, after = self.texts[p - 1], self.texts[p]
        if not (before[-1:].isspace() or after[:1].isspace()):
            return ANYWHERE
        if before.rstrip().rstrip(CLOSERS).endswith(CLAUSE_END):
            return CLAUSE
        return CONJUNCTION if after.strip().lower() in CONJUNCTIONS else WORD

    def sliver(self, a: int, b: int) -> bool:
        """Whether tokens ``[a, b)`` are too few to stand alone (edge whitespace not counted)."""
        if b - a < MIN_TOKENS:
            return True
        first, last = self.texts[a], self.texts[b - 1]
        edges = len(first) - len(first.lstrip()) + len(last) - len(last.rstrip())
        return self.chars[b] - self.chars[a] - edges < MIN_CHARS

    def pieces(self, start: int, end: int, size: int) -> list[Chunk]:
        """The sentence ``[start, end)`` cut into pieces of at most ``size`` tokens."""
        out: list[Chunk] = []
        a = start
        while end - a > size:
            window = range(a + 1, a + size + 1)
            whole = [p for p in window if not self.sliver(a, p) and not self.sliver(p, end)]
            enough = [p for p in window if p - a >= MIN_TOKENS and end - p >= MIN_TOKENS]
            options = whole or enough
            p = min(options, key=lambda p: (self.kind(p), -p)) if options else a + size
            out.append(Chunk(a, p, mid_sentence=True))
            a = p
        out.append(Chunk(a, end))
        return out


def sentence_chunks(token_texts: Sequence[str], max_len: int = 64) -> list[Chunk]:
    """Sentences (or lines) from per-token texts, longer ones cut into pieces of at most
    ``max_len`` tokens (see the module docstring)."""
    cuts = _Cuts(token_texts)
    out: list[Chunk] = []
    start, n = 0, len(token_texts)
    for i, text in enumerate(token_texts):
        nxt = token_texts[i + 1] if i + 1 < n else None
        if _ends_sentence(text, nxt):
            out.extend(cuts.pieces(start, i + 1, max_len))
            start = i + 1
    if start < n:
        out.extend(cuts.pieces(start, n, max_len))
    return out


def packed_chunks(token_texts: Sequence[str], size: int = 32) -> list[Chunk]:
    """Sentences and pieces of long ones packed in order into units of at most ``size`` tokens."""
    out: list[Chunk] = []
    cur: Chunk | None = None
    for s in sentence_chunks(token_texts, max_len=size):
        if cur is not None and len(cur) + len(s) <= size:
            cur = Chunk(cur.start, s.end, s.mid_sentence)
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
        return sentence_chunks(token_texts, max_len=max_unit(granularity, size))
    if granularity == "packed":
        return packed_chunks(token_texts, size)
    raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
