"""Calibrate the drafter reader: which (layer, head) ranks the evidence first, and what to keep.

On offline items whose evidence is known (the needle sentence, the gold NQ passage), built with
other seeds than the evaluation sets (the sweep uses seed 0):

1. ``heads``: read each prompt with the drafter (every layer, one document pass), take each
   head's attention from the final tokens (with and without the look-ahead draft block) onto
   the context, mean-pooled per 32-token chunk, and measure the fraction of chunks scoring above
   the evidence chunk (0 = evidence first, 0.5 = chance). Heads are listed best first.
2. ``recall``: for given scorer settings, the evidence recall at each keep ratio (share of items
   whose evidence survives compression whole: the needle sentence, or a gold answer string).

    python -m eval.longbench.calibrate heads --seeds 7,8 --threads 1
    python -m eval.longbench.calibrate recall --reader target --layers 8 --heads 7:7 \
        --quantize --lookahead off --seeds 7,8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from compression.compressor import SCORERS, CompressionConfig, Compressor
from compression.doc_cache import DocumentCache
from compression.drafter_scorers import AttentionScoring, DrafterAttentionScorer
from compression.presets import make_attention_scorer
from compression.prompt import PromptParts
from compression.selection import pool
from compression.units import fixed_chunks
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


def head_table(
    scorers: list[DrafterAttentionScorer], items: list[Item], tokenizer
) -> list[torch.Tensor]:
    """Mean rank fraction per head over the items, one [layers, heads] table per scorer.

    The scorers share one reader model; each item's document pass is read once."""
    tables: list[list[torch.Tensor]] = [[] for _ in scorers]
    for item in items:
        parts = item_parts(item, tokenizer, 8000)
        span = evidence_span(item, parts, tokenizer.decode)
        cache = scorers[0].read_window(parts.prefix, parts.context)
        for k, scorer in enumerate(scorers):
            a = scorer.query(cache, parts.suffix, len(parts.prefix)).mean(2)  # [L, heads, C]
            fr = [
                [rank_fraction(a[i, h], span) for h in range(a.shape[1])] for i in range(a.shape[0])
            ]
            tables[k].append(torch.tensor(fr))
    return [torch.stack(t).mean(0) for t in tables]


def evidence_kept(item: Item, kept_text: str) -> bool:
    if "needle" in item.meta:
        return item.meta["needle"] in kept_text
    low = kept_text.lower()
    return any(a.lower() in low for a in item.answers if a.strip())


def calibration_items(tokenizer, seeds: str, sizes: str, per_size: int) -> list[Item]:
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    items: list[Item] = []
    for seed in (int(s) for s in seeds.split(",")):
        for size in (int(s) for s in sizes.split(",")):
            items += needle_items(count, size, per_size, seed)
            items += nq_multidoc(count, size, per_size, seed)
    return items


def _heads(text: str | None) -> tuple[tuple[int, int], ...] | None:
    if not text:
        return None
    return tuple((int(a), int(b)) for a, b in (p.split(":") for p in text.split(",")))


def main(argv: list[str] | None = None) -> int:
    from d3d.engine import build_drafter
    from d3d.model.load import load_target

    p = argparse.ArgumentParser(prog="python -m eval.longbench.calibrate", description=__doc__)
    p.add_argument("what", choices=["heads", "recall"])
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default")
    p.add_argument("--seeds", default="7,8")
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--per-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--heads", default=None, help="recall: layer:head list for the attention")
    p.add_argument("--quantize", action="store_true")
    p.add_argument("--reader", default="drafter", choices=["drafter", "target"])
    p.add_argument("--layers", type=int, default=None, help="recall: reading depth")
    p.add_argument("--lookahead", default="on", choices=["on", "off"])
    p.add_argument("--scorers", default="bm25,drafter-attention,hybrid")
    p.add_argument("--granularities", default="chunk,sentence,packed")
    p.add_argument("--neighbours", default="0")
    p.add_argument("--keep", default="0.2,0.1,0.05")
    p.add_argument("--weights", default="1,1", help="recall: hybrid weights attention,bm25")
    p.add_argument("--head", default="0", help="recall: shares of the budget for the doc head")
    p.add_argument("--window", type=int, default=None, help="recall: reading window (tokens)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafter = build_drafter(args.drafter, target)
    tok = target.tokenizer
    items = calibration_items(tok, args.seeds, args.sizes, args.per_size)
    if args.what == "heads":
        cfgs = [
            AttentionScoring(layers=args.layers, reader=args.reader, lookahead=la)
            for la in (False, True)
        ]
        first = make_attention_scorer(cfgs[0], drafter, target.model)
        second = DrafterAttentionScorer.__new__(DrafterAttentionScorer)
        second._setup(first.model, cfgs[1])  # the same reader, with the look-ahead block
        scorers = [first, second]
        out: dict = {"items": len(items)}
        for la, table in zip(("off", "on"), head_table(scorers, items, tok), strict=True):
            order = sorted(
                (float(table[i, h]), i, h)
                for i in range(table.shape[0])
                for h in range(table.shape[1])
            )
            out[f"lookahead_{la}"] = {
                "best_heads": [
                    {"layer": i, "head": h, "rank_fraction": round(f, 4)}
                    for f, i, h in order[: args.top]
                ],
                "per_layer_best": [round(float(table[i].min()), 4) for i in range(table.shape[0])],
            }
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    att_cfg = AttentionScoring(
        layers=args.layers,
        reader=args.reader,
        heads=_heads(args.heads),
        quantize=args.quantize,
        lookahead=args.lookahead == "on",
        window=args.window,
    )
    att = make_attention_scorer(att_cfg, drafter, target.model)
    att.cache = DocumentCache(max_entries=len(items) + 1, max_bytes=8 << 30)
    w = tuple(float(x) for x in args.weights.split(","))
    keeps = [float(k) for k in args.keep.split(",")]
    rows = []
    grid = [
        (gran, nb, name, float(head))
        for gran in args.granularities.split(",")
        for nb in (int(x) for x in args.neighbours.split(","))
        for name in args.scorers.split(",")
        for head in args.head.split(",")
    ]
    for gran, nb, name, head in grid:
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}")
        cfg = CompressionConfig(
            scorer=name, granularity=gran, neighbours=nb, attention=att_cfg,
            fusion_weights=w, head=head,  # type: ignore[arg-type]
        )  # fmt: skip
        comp = Compressor.build(replace(cfg), tok, drafter, target.model, att)
        kept = {k: 0 for k in keeps}
        secs = 0.0
        for item in items:
            parts = item_parts(item, tok, 8000)
            t0 = time.perf_counter()
            scored = comp.score(parts)
            secs += time.perf_counter() - t0
            for k in keeps:
                text = tok.decode(comp.select(parts, scored, k).parts.context)
                kept[k] += evidence_kept(item, text)
        rows.append(
            {
                "granularity": gran,
                "neighbours": nb,
                "scorer": name,
                "head": head,
                "recall": {f"{k:g}": round(kept[k] / len(items), 3) for k in keeps},
                "score_s": round(secs / len(items), 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
