"""Offline long-document sets of real length, built from ``../shared/data``.

- ``nq_multidoc_<n>k``: one Natural Questions row's gold passage among other rows' passages
  (distractors) up to about n x 1024 context tokens, the gold passage at a seeded depth; LongBench's
  hotpotqa prompt; ``qa_f1_score`` (max over answers); 32 new tokens.
- ``needle_<n>k``: Paul Graham essays up to about n x 1024 context tokens with one synthetic
  "needle" sentence at a seeded depth (on a paragraph boundary), and a question only the needle
  answers; ``substring_match_score``; 24 new tokens.

Sizes are context budgets in target tokens (``count_tokens``), leaving room in the model's window
for the template, the question and the answer: 2k -> 1,800, 4k -> 3,800, 8k -> 7,600. Everything
is deterministic given the seed.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from eval.longbench.data import REPO_ROOT, Item, dataset2prompt

DATA_DIR = REPO_ROOT.parent / "shared" / "data"
CONTEXT_BUDGET = {2: 1800, 4: 3800, 8: 7600}
NEEDLE_TEMPLATE = (
    "Read the essays below and answer the question that follows.\n\n{context}\n\n"
    "Answer the question based on the essays above. Only give me the answer and do not output "
    "any other words.\n\nQuestion: {input}\nAnswer:"
)
NEEDLES = (
    (
        "The secret code for the Lisbon archive is 4817.",
        "What is the secret code for the Lisbon archive?",
        "4817",
    ),
    (
        "Marta's favourite fruit is the purple mangosteen.",
        "What is Marta's favourite fruit?",
        "mangosteen",
    ),
    (
        "The lighthouse keeper's dog is named Biscuit.",
        "What is the lighthouse keeper's dog named?",
        "Biscuit",
    ),
    (
        "The best thing to do in San Francisco is to eat a sandwich in Dolores Park.",
        "What is the best thing to do in San Francisco?",
        "eat a sandwich in Dolores Park",
    ),
    (
        "The red notebook is hidden under the third stair.",
        "Where is the red notebook hidden?",
        "under the third stair",
    ),
    (
        "Professor Okafor's lucky number is 7392.",
        "What is Professor Okafor's lucky number?",
        "7392",
    ),
    (
        "The Zephyr project launches on the ninth of March.",
        "When does the Zephyr project launch?",
        "ninth of March",
    ),
    (
        "The password to the garden shed is tangerine.",
        "What is the password to the garden shed?",
        "tangerine",
    ),
    (
        "The museum's oldest clock was built in Prague.",
        "Where was the museum's oldest clock built?",
        "Prague",
    ),
    (
        "Captain Reyes sails a boat called the Silver Heron.",
        "What is the name of Captain Reyes's boat?",
        "Silver Heron",
    ),
    (
        "The winning cake at the village fair was made with cardamom.",
        "What spice was the winning cake at the village fair made with?",
        "cardamom",
    ),
    (
        "The spare key to the studio is kept inside a blue teapot.",
        "Where is the spare key to the studio kept?",
        "inside a blue teapot",
    ),
)

SENTENCE = re.compile(r"(?<=[.!?])\s+")
CountTokens = Callable[[str], int]


def _fill(pieces: list[str], count: CountTokens, budget: int) -> list[str]:
    """The leading pieces whose token count (each counted alone, plus a separator) fits."""
    out, used = [], 0
    for p in pieces:
        n = count(p) + 2
        if used + n > budget:
            if budget - used < 24:
                break
            continue
        out.append(p)
        used += n
    return out


def nq_rows(path: Path | None = None) -> list[dict]:
    path = path or DATA_DIR / "nq_open_oracle" / "nq-open-oracle.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"NQ passages not found: {path}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def nq_multidoc(
    count: CountTokens, size_k: int, n: int, seed: int = 0, rows: list[dict] | None = None
) -> list[Item]:
    """``n`` multi-document NQ items at about ``size_k`` x 1024 context tokens."""
    rows = rows if rows is not None else nq_rows()
    budget = CONTEXT_BUDGET.get(size_k, size_k * 950)
    rng = random.Random(f"nq-{size_k}-{seed}")
    picks = rng.sample(range(len(rows)), n)
    items = []
    for k, idx in enumerate(picks):
        row = rows[idx]
        gold = row["ctxs"][0]
        others = [rows[j]["ctxs"][0] for j in rng.sample(range(len(rows)), min(400, len(rows)))]
        others = [p for p in others if p["title"] != gold["title"]]
        docs = [f"{p['title']}\n{p['text']}" for p in others]
        gold_doc = f"{gold['title']}\n{gold['text']}"
        kept = _fill(docs, count, budget - count(gold_doc) - 2)
        depth = (k % 5) / 4  # 0, 0.25, 0.5, 0.75, 1 of the way through
        pos = round(depth * len(kept))
        kept.insert(pos, gold_doc)
        context = "\n".join(f"Passage {i + 1}:\n{d}" for i, d in enumerate(kept))
        items.append(
            Item(
                id=f"nq{size_k}k-{idx}",
                dataset=f"nq_multidoc_{size_k}k",
                input=row["question"],
                context=context,
                answers=tuple(row["answers"]),
                template=dataset2prompt()["hotpotqa"],
                max_new_tokens=32,
                metric="qa_f1_score",
                meta={"gold_passage": pos + 1, "depth": depth},
            )
        )
    return items


def essay_paragraphs(folder: Path | None = None, sentences: int = 5) -> list[str]:
    """The essays as pieces of ``sentences`` sentences (the files are hard-wrapped lines)."""
    folder = folder or DATA_DIR / "paul_graham_essays"
    files = sorted(Path(folder).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays (*.txt) under {folder}")
    paras = []
    for f in files:
        text = " ".join(f.read_text(encoding="utf-8").split())
        sents = [s for s in SENTENCE.split(text) if s]
        paras += [" ".join(sents[i : i + sentences]) for i in range(0, len(sents), sentences)]
    return paras


def needle_items(
    count: CountTokens, size_k: int, n: int, seed: int = 0, paragraphs: list[str] | None = None
) -> list[Item]:
    """``n`` needle-in-essays items at about ``size_k`` x 1024 context tokens."""
    paras = paragraphs if paragraphs is not None else essay_paragraphs()
    budget = CONTEXT_BUDGET.get(size_k, size_k * 950)
    rng = random.Random(f"needle-{size_k}-{seed}")
    items = []
    for k in range(n):
        needle, question, answer = NEEDLES[(k + 3 * size_k) % len(NEEDLES)]
        start = rng.randrange(len(paras))
        ordered = paras[start:] + paras[:start]
        hay = _fill(ordered, count, budget - count(needle) - 2)
        depth = [0.1, 0.35, 0.6, 0.85][k % 4]
        pos = round(depth * len(hay))
        hay.insert(pos, needle)
        items.append(
            Item(
                id=f"needle{size_k}k-{k}",
                dataset=f"needle_{size_k}k",
                input=question,
                context="\n\n".join(hay),
                answers=(answer,),
                template=NEEDLE_TEMPLATE,
                max_new_tokens=24,
                metric="substring_match_score",
                meta={"needle": needle, "depth": depth},
            )
        )
    return items


def offline_sets(
    count: CountTokens, sizes: tuple[int, ...] = (2, 4, 8), per_size: int = 4, seed: int = 0
) -> list[Item]:
    """Both offline sets at every size, ``per_size`` items each."""
    rows = nq_rows()
    paras = essay_paragraphs()
    out: list[Item] = []
    for k in sizes:
        out += needle_items(count, k, per_size, seed, paras)
        out += nq_multidoc(count, k, per_size, seed, rows)
    return out
