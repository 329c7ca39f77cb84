"""Needles in messy text: facts inside run-on sentences, no line breaks, paraphrased questions.

Documents as users often paste them (text pulled from a PDF): one long line of essay text, twelve
facts each merged into a sentence of the essay rather than standing alone, and half of the
questions worded with none of the fact's content words, so word matching cannot find them:

- the fact *ends* a run-on sentence ("..., and the password to the garden shed is tangerine."),
- *starts* one ("The red notebook is hidden under the third stair, and ..."), or
- sits in its *middle* ("..., and the museum's oldest clock was built in Prague, and ...").

Every question is asked about the same document (a reader's document cache serves all twelve).
A fact is kept when its text survives whole in the kept prompt (:func:`fact_kept`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from eval.longbench.data import Item
from eval.longbench.offline import NEEDLE_TEMPLATE, essay_paragraphs

SENTENCE = re.compile(r"(?<=[.!?])\s+")
STYLES = ("end", "start", "middle")


@dataclass(frozen=True)
class Fact:
    """A fact (lower-case clause, merged into an essay sentence), its question, its answer."""

    text: str
    question: str
    answer: str
    paraphrased: bool


FACTS = (
    Fact("the secret code for the Lisbon archive is 4817",
         "What is the secret code for the Lisbon archive?", "4817", False),
    Fact("the lighthouse keeper's dog is named Biscuit",
         "What do people call the pet of the man who tends the coastal beacon?", "Biscuit", True),
    Fact("Marta's favourite fruit is the purple mangosteen",
         "What is Marta's favourite fruit?", "mangosteen", False),
    Fact("the red notebook is hidden under the third stair",
         "Where has the crimson journal been concealed?", "under the third stair", True),
    Fact("Professor Okafor's lucky number is 7392",
         "What is Professor Okafor's lucky number?", "7392", False),
    Fact("the password to the garden shed is tangerine",
         "Which secret word opens the little hut out in the backyard?", "tangerine", True),
    Fact("the Zephyr project launches on the ninth of March",
         "When does the Zephyr project launch?", "ninth of March", False),
    Fact("the museum's oldest clock was built in Prague",
         "In which city was the gallery's most ancient timepiece made?", "Prague", True),
    Fact("Captain Reyes sails a boat called the Silver Heron",
         "What is the name of Captain Reyes's boat?", "Silver Heron", False),
    Fact("the winning cake at the village fair was made with cardamom",
         "Which seasoning gave the champion dessert at the rural festival its taste?",
         "cardamom", True),
    Fact("the best thing to do in San Francisco is to eat a sandwich in Dolores Park",
         "What is the best thing to do in San Francisco?", "eat a sandwich in Dolores Park",
         False),
    Fact("the spare key to the studio is kept inside a blue teapot",
         "Where is the duplicate for the workshop's lock stored?", "inside a blue teapot", True),
)  # fmt: skip


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:1].isupper() and not s[1:2].isupper() else s


def _upper_first(s: str) -> str:
    return s[:1].upper() + s[1:]


def merge(fact: str, before: str, after: str, style: str) -> tuple[str, str]:
    """The two essay sentences around an insertion point with ``fact`` merged into them."""
    if style == "end":  # "Before, and the fact." + after
        return f"{before.rstrip('.!?')}, and {fact}.", after
    if style == "start":  # before + "The fact, and after."
        return before, f"{_upper_first(fact)}, and {_lower_first(after)}"
    if style == "middle":  # "Before, and the fact, and after."
        return f"{before.rstrip('.!?')}, and {fact}, and {_lower_first(after)}", ""
    raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")


def messy_document(words: int = 4000, seed: int = 0, facts: tuple[Fact, ...] = FACTS) -> str:
    """About ``words`` words of essays on one line, each fact merged into a sentence."""
    rng = random.Random(f"messy-{words}-{seed}")
    paras = essay_paragraphs()
    start = rng.randrange(len(paras))
    text, n = [], 0
    for p in paras[start:] + paras[:start]:
        text.append(p)
        n += len(p.split())
        if n >= words:
            break
    sents = [s for s in SENTENCE.split(" ".join(text)) if s]
    # Insertion points spread evenly (jittered) over the sentences, never the first or last.
    step = (len(sents) - 2) / len(facts)
    points = [1 + int(step * (i + rng.random() * 0.5)) for i in range(len(facts))]
    for i, (fact, at) in reversed(list(enumerate(zip(facts, points, strict=True)))):
        before, after = merge(fact.text, sents[at - 1], sents[at], STYLES[i % len(STYLES)])
        sents[at - 1 : at + 1] = [s for s in (before, after) if s]
    return " ".join(sents)


def messy_items(words: int = 4000, seed: int = 0) -> list[Item]:
    """The twelve questions about one messy document, as evaluation items."""
    doc = messy_document(words, seed)
    return [
        Item(
            id=f"messy{words}-{seed}-{k}",
            dataset="messy_needles",
            input=f.question,
            context=doc,
            answers=(f.answer,),
            template=NEEDLE_TEMPLATE,
            max_new_tokens=24,
            metric="substring_match_score",
            meta={"needle": f.text, "paraphrased": f.paraphrased, "style": STYLES[k % 3]},
        )
        for k, f in enumerate(FACTS)
    ]


def fact_kept(item: Item, kept_text: str) -> bool:
    """Whether the item's fact survives whole (case and spacing aside) in ``kept_text``."""
    norm = " ".join(kept_text.split()).lower()
    return " ".join(item.meta["needle"].split()).lower() in norm
