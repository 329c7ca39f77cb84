"""``d3d qa`` end to end: full prompt vs keep 0.1, first vs second question, draft prefixes.

For each document size (essays with six needle facts, the needle family of the tests), in one
process with models loaded once, :class:`compression.qa.DocumentQA` (what ``d3d qa`` runs):

- ``full``: keep 1.0 (no scoring), ``--repeats`` times with empty caches, questions rotating;
- ``first``: keep 0.1 with empty caches, question k (the reader reads the document while the
  target encodes the instruction and the document's head);
- ``second``: keep 0.1, question k+1 right after (the reader's pass and the target's KV of the
  instruction and head come from the caches).

First and second run as ``--pairs`` pairs, k = 0, 1, ...: with six pairs every needle is asked
once first and once second, so both sides answer the same questions (answers differ in length
and in how much of them the document supplies to copy). Medians are reported with the scoring's
share of ``total_s``, the second question's stages, and the ratios. ``--draft-prefix`` adds the acceptance comparison of item 3:
``sync`` decoding of the kept prompt with the drafter reading the kept prompt, against the
drafter reading the full document (``draft_prompt_ids``), on the same items; both answers must
be equal (lossless). It times: run it with nothing else busy on the machine:

    python -m eval.longbench.qa_bench --sizes 4,8 --threads 0 --out eval/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from compression.compressor import CompressionConfig
from compression.doc_cache import DocumentCache
from compression.qa import DocumentQA
from d3d.config import MODES, DecodeConfig
from eval.longbench.offline import CONTEXT_BUDGET, essay_paragraphs

NEEDLES = (
    ("The secret code for the Lisbon archive is 4817.",
     "What is the secret code for the Lisbon archive?", "4817"),
    ("Marta's favourite fruit is the purple mangosteen.",
     "Which fruit does Marta like best?", "mangosteen"),
    ("Professor Okafor's lucky number is 7392.",
     "What is Professor Okafor's lucky number?", "7392"),
    ("The museum's oldest clock was built in Prague.",
     "In which city was the museum's oldest clock built?", "Prague"),
    ("The spare key to the studio is kept inside a blue teapot on the top shelf.",
     "Where is the spare key to the studio kept?", "teapot"),
    ("Captain Reyes sails a boat called the Silver Heron.",
     "What is the name of Captain Reyes's boat?", "Silver Heron"),
)  # fmt: skip


def document(count, size_k: int, seed: int = 0) -> str:
    """Essay paragraphs up to the size's context budget, the needles spread through them."""
    budget = CONTEXT_BUDGET.get(size_k, size_k * 950)
    paras, used, out = essay_paragraphs()[seed * 40 :], 0, []
    for p in paras:
        n = count(p) + 2
        if used + n > budget - 120:
            break
        out.append(p)
        used += n
    for k, (needle, _, _) in enumerate(NEEDLES):
        out.insert(round((k + 0.5) / len(NEEDLES) * len(out)) + k, needle)
    return "\n\n".join(out)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r["timings"][key] for r in rows)


def run_size(qa: DocumentQA, size_k: int, dcfg: DecodeConfig, repeats: int, pairs: int) -> dict:
    tok = qa.tokenizer
    text = document(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), size_k)
    full, first, second = [], [], []
    for r in range(max(repeats, pairs)):
        if r < repeats:  # cold: the document's KV would otherwise be reused from the last run
            qa.forget()
            full.append(
                qa.answer(text, NEEDLES[r % len(NEEDLES)][1], dcfg, keep_ratio=1.0).to_dict()
            )
        if r >= pairs:
            continue
        # Pair r asks needle r, then needle r + 1: over six pairs every question is asked once
        # first and once second, so the two sides answer the same questions.
        q1, q2 = NEEDLES[r % len(NEEDLES)], NEEDLES[(r + 1) % len(NEEDLES)]
        qa.forget()
        first.append(qa.answer(text, q1[1], dcfg, keep_ratio=0.1).to_dict())
        second.append(qa.answer(text, q2[1], dcfg, keep_ratio=0.1).to_dict())
        first[-1]["correct"] = q1[2].lower() in first[-1]["answer"].lower()
        second[-1]["correct"] = q2[2].lower() in second[-1]["answer"].lower()
    f, a, b = (median(x, "total_s") for x in (full, first, second))
    return {
        "size_k": size_k,
        "total_tokens": full[0]["compression"]["total_tokens"],
        "kept_tokens": first[0]["compression"]["kept_tokens"],
        "full_total_s": f,
        "first_total_s": a,
        "second_total_s": b,
        "first_compress_s": median(first, "compress_s"),
        "second_compress_s": median(second, "compress_s"),
        "full_prefill_s": median(full, "prefill_s"),
        "second_prefill_s": median(second, "prefill_s"),
        "second_decode_s": median(second, "decode_s"),
        "answer_tokens": sum(x["speculative"]["num_tokens"] for x in first + second),
        "copied_tokens": sum(x["speculative"]["copy_accepted_tokens"] for x in first + second),
        "copy_rounds": sum(x["speculative"]["copy_drafts"] for x in first + second),
        "speedup_first": f / a,
        "speedup_second": f / b,
        "second_vs_first": a / b,
        "scoring_share_first": median(first, "compress_s") / a,
        "scoring_vs_full_prefill": median(first, "compress_s") / median(full, "prefill_s"),
        "head_tokens": first[0]["compression"]["head_tokens"],
        "second_cached_prompt_tokens": second[0]["speculative"]["cached_prompt_tokens"],
        "answers_correct": sum(x["correct"] for x in first + second),
        "answers": len(first) + len(second),
        "runs": {"full": full, "first": first, "second": second},
    }


def draft_prefix(qa: DocumentQA, size_k: int, new_tokens: int) -> list[dict]:
    """Acceptance with the drafter reading the kept prompt vs the full document (sync)."""
    tok = qa.tokenizer
    text = document(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), size_k, seed=1)
    dcfg = DecodeConfig(mode="sync", max_new_tokens=new_tokens)
    out = []
    for _, question, answer in NEEDLES:
        parts = qa.parts(text, question)
        comp = qa.compress(parts, 0.1)
        kept = qa.engine.generate_ids(comp.parts.ids, dcfg)
        whole = qa.engine.generate_ids(comp.parts.ids, dcfg, draft_prompt_ids=parts.ids)
        out.append(
            {
                "question": question,
                "answer": kept.text,
                "correct": answer.lower() in kept.text.lower(),
                "same_answer": kept.token_ids == whole.token_ids,
                "kept_prompt": kept.stats.to_dict(),
                "full_document": whole.stats.to_dict(),
            }
        )
        print(json.dumps({k: out[-1][k] for k in ("question", "same_answer")}), flush=True)
    return out


def markdown(rows: list[dict], mode: str, meta: dict) -> str:
    lines = [
        f"`d3d qa` (DocumentQA), keep 0.1 vs the full prompt, mode {mode}, "
        f"{meta['threads']} torch thread(s), medians over runs. `{meta['command']}`",
        "",
        "| doc | tokens | kept | head + instruction | full s | first s | second s | speed-up "
        "(first) | speed-up (second) | second vs first | scoring s | scoring share | scoring / "
        "full prefill | second: query / prefill / decode s | answer tokens copied | correct |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size_k']}k | {r['total_tokens']} | {r['kept_tokens']} | "
            f"{r['second_cached_prompt_tokens']} | "
            f"{r['full_total_s']:.2f} | {r['first_total_s']:.2f} | {r['second_total_s']:.2f} | "
            f"{r['speedup_first']:.2f}x | {r['speedup_second']:.2f}x | "
            f"{r['second_vs_first']:.2f}x | {r['first_compress_s']:.2f} | "
            f"{100 * r['scoring_share_first']:.0f} % | "
            f"{100 * r['scoring_vs_full_prefill']:.1f} % | "
            f"{r['second_compress_s']:.2f} / {r['second_prefill_s']:.2f} / "
            f"{r['second_decode_s']:.2f} | "
            f"{r['copied_tokens']}/{r['answer_tokens']} in {r['copy_rounds']} rounds | "
            f"{r['answers_correct']}/{r['answers']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from d3d.config import ModelConfig
    from d3d.engine import Engine

    p = argparse.ArgumentParser(prog="python -m eval.longbench.qa_bench", description=__doc__)
    p.add_argument("--sizes", default="4,8")
    p.add_argument("--repeats", type=int, default=3, help="full-prompt runs per size")
    p.add_argument(
        "--pairs",
        type=int,
        default=6,
        help="first/second question pairs per size (6: each "
        "needle asked once first and once second)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for the target (0, the default: torch's, every core, as `d3d qa` "
        "runs; 1: the target on one core, the two-device layout)",
    )
    p.add_argument("--mode", default="auto" if "auto" in MODES else "sync")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument(
        "--head",
        type=float,
        default=None,
        help="share of the budget for the document's head (default: the compressor's)",
    )
    p.add_argument("--draft-prefix", action="store_true", help="also compare draft prefixes")
    p.add_argument("--only-draft-prefix", action="store_true")
    p.add_argument("--out", default="eval/results")
    args = p.parse_args(argv)
    engine = Engine.from_config(ModelConfig(threads=args.threads or None))
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = CompressionConfig() if args.head is None else CompressionConfig(head=args.head)
    qa = DocumentQA(engine, cfg, cache=DocumentCache())
    dcfg = DecodeConfig(mode=args.mode, max_new_tokens=args.max_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    if not args.only_draft_prefix:
        rows = [run_size(qa, k, dcfg, args.repeats, args.pairs) for k in sizes]
        meta = {"command": "python -m eval.longbench.qa_bench " + " ".join(argv or sys.argv[1:])}
        meta["threads"] = torch.get_num_threads()
        doc = {**meta, "mode": args.mode, "compression": asdict(qa.cfg), "rows": rows}
        (out / "qa_speed.json").write_text(json.dumps(doc, indent=2))
        table = markdown(rows, args.mode, meta)
        (out / "qa_speed.md").write_text(table)
        print(table)
    if args.draft_prefix or args.only_draft_prefix:
        rows = [r for k in sizes for r in draft_prefix(qa, k, args.max_new_tokens)]
        kept = [r["kept_prompt"]["acceptance_length"] for r in rows]
        whole = [r["full_document"]["acceptance_length"] for r in rows]
        summary = {
            "items": len(rows),
            "acceptance_kept_prompt": statistics.mean(kept),
            "acceptance_full_document": statistics.mean(whole),
            "same_answers": sum(r["same_answer"] for r in rows),
        }
        (out / "draft_prefix.json").write_text(json.dumps({**summary, "rows": rows}, indent=2))
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
