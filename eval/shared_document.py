"""Several questions about one document at once, against the same questions one after another.

Starts ``d3d serve`` and, per repeat, takes two fresh messy documents of the same size
(:func:`eval.longbench.messy.messy_document`, other seeds: nothing of them is cached yet):

- **one after another**: the questions about document A posted one at a time (the first reads
  the document, the rest take its KV from the prefix cache);
- **at once**: the same questions about document B posted together.

At keep 1.0 the whole document is the prefix the questions share, so "at once" should cost
what "one after another" does: one reading of the document and each question's own suffix.
It reports both wall times, each answer's ``cached_prompt_tokens``, and whether the answers
posted at once equal those of the same questions asked again one at a time (greedy, ``ar``).
It times: run it with nothing else busy.

    python -m eval.shared_document --keep 1 --out eval/results/shared_document
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx

from eval.longbench.messy import FACTS, messy_document
from eval.serve_load import served


def ask(url: str, document: str, question: str, keep: float, tokens: int) -> dict:
    body = {
        "document": document,
        "question": question,
        "keep_ratio": keep,
        "max_new_tokens": tokens,
        "speculative": {"mode": "ar"},
    }
    t0 = time.perf_counter()
    r = httpx.post(url + "/qa", json=body, timeout=900)
    r.raise_for_status()
    out = r.json()
    return {
        "seconds": round(time.perf_counter() - t0, 3),
        "cached_prompt_tokens": out["speculative"]["cached_prompt_tokens"],
        "answer": out["answer"],
    }


def run(url: str, questions: list[str], keep: float, tokens: int, repeats: int, words: int):
    rows = []
    for r in range(repeats):
        a, b = (messy_document(words, seed=100 + 2 * r + k) for k in (0, 1))
        t0 = time.perf_counter()
        seq = [ask(url, a, q, keep, tokens) for q in questions]
        t1 = time.perf_counter()
        with ThreadPoolExecutor(len(questions)) as pool:
            par = list(pool.map(partial(ask, url, b, keep=keep, tokens=tokens), questions))
        t2 = time.perf_counter()
        again = [ask(url, b, q, keep, tokens) for q in questions]
        rows.append(
            {
                "one_after_another_s": round(t1 - t0, 3),
                "at_once_s": round(t2 - t1, 3),
                "at_once_vs_one_after_another": round((t2 - t1) / (t1 - t0), 3),
                "one_after_another": seq,
                "at_once": par,
                "at_once_identical": [x["answer"] for x in par] == [x["answer"] for x in again],
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k.endswith(("_s", "after"))}))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.shared_document", description=__doc__)
    p.add_argument("--out", default="eval/results/shared_document")
    p.add_argument("--port", type=int, default=8137)
    p.add_argument("--keep", type=float, default=1.0)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--words", type=int, default=4000, help="document size")
    p.add_argument("--threads", type=int, default=None, help="the server's --threads")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--threads", str(args.threads)] if args.threads else []
    with served(flags, args.port, out / "server.log") as srv:
        questions = [f.question for f in FACTS[: args.questions]]
        rows = run(srv.url, questions, args.keep, args.tokens, args.repeats, args.words)
        doc = {
            "command": "python -m eval.shared_document "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "server": srv.args,
            "keep": args.keep,
            "questions": questions,
            "runs": rows,
        }
        (out / "shared_document.json").write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
