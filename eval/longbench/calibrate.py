"""Find the reader's retrieval heads: which (layer, head) ranks the evidence chunk first.

For offline items whose evidence position is known (the needle sentence, the gold NQ passage),
read the prompt with the first ``layers`` layers, take each head's attention from the final
tokens onto the context (mean over queries, mean-pooled per chunk), and measure the fraction of
chunks that score above the evidence chunk (0 = evidence first, 0.5 = chance). Heads are
listed best first. Use seeds other than the evaluation sets' (the sweep uses seed 0).

    python -m eval.longbench.calibrate --layers 8 --seeds 7,8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from compression.drafter_scorers import AttentionScoring, DrafterAttentionScorer
from compression.prompt import PromptParts
from compression.selection import fixed_chunks, pool
from eval.longbench.data import Item
from eval.longbench.offline import needle_items, nq_multidoc
from eval.longbench.prompts import item_parts


def evidence_span(item: Item, parts: PromptParts, decode) -> tuple[int, int]:
    """Context token span [start, end) of the item's evidence (needle or gold passage header)."""
    key = item.meta.get("needle") or f"Passage {item.meta['gold_passage']}:\n"
    text_pos = decode(parts.context).find(key)
    if text_pos < 0:
        raise ValueError(f"evidence of {item.id} not found in its context")
    chars, start = 0, 0
    for i, t in enumerate(parts.context):
        chars += len(decode([t]))
        if chars > text_pos:
            start = i
            break
    return start, start + (len(key) // 4 if "needle" in item.meta else 40)


def rank_fraction(scores: torch.Tensor, span: tuple[int, int], chunk: int = 32) -> float:
    """Fraction of chunks scoring above the best chunk of the evidence span: scores [C]."""
    chunks = fixed_chunks(scores.numel(), chunk)
    cs = pool(scores, chunks)
    gold = cs[span[0] // chunk : (span[1] - 1) // chunk + 1].max()
    return float((cs > gold).float().mean())


def head_table(scorer: DrafterAttentionScorer, items: list[Item], tokenizer) -> torch.Tensor:
    """Mean rank fraction per head over the items: [layers, heads]."""
    fractions = []
    for item in items:
        parts = item_parts(item, tokenizer, 8000)
        span = evidence_span(item, parts, tokenizer.decode)
        a = scorer.attention(parts).mean(2)  # [L, heads, C]
        layers, heads = a.shape[0], a.shape[1]
        fr = [[rank_fraction(a[i, h], span) for h in range(heads)] for i in range(layers)]
        fractions.append(torch.tensor(fr))
    return torch.stack(fractions).mean(0)


def main(argv: list[str] | None = None) -> int:
    from d3d.models import load_target

    p = argparse.ArgumentParser(prog="python -m eval.longbench.calibrate", description=__doc__)
    p.add_argument("--target", default="default")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seeds", default="7,8")
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--per-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    tok = target.tokenizer

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    items: list[Item] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for size in (int(s) for s in args.sizes.split(",")):
            items += needle_items(count, size, args.per_size, seed)
            items += nq_multidoc(count, size, args.per_size, seed)
    cfg = AttentionScoring(layers=args.layers, reader="target", lookahead=False)
    table = head_table(DrafterAttentionScorer(target.model, cfg), items, tok)
    order = sorted(
        (float(table[i, h]), i, h) for i in range(table.shape[0]) for h in range(table.shape[1])
    )
    best = [{"layer": i, "head": h, "rank_fraction": round(f, 4)} for f, i, h in order[: args.top]]
    json.dump({"items": len(items), "best_heads": best}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
