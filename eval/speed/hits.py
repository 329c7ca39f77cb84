"""``python -m eval.speed.hits``: branch hit rate against the number of branches, and why.

Timing-free: the drafter worker runs in a thread with a *fixed* number of branches per round
(``ServerConfig.fixed_branches``), so the hit rate depends only on the drafter's predictions,
not on the machine. For each count it decodes the same held-out prompts with ``async`` and
records the hit rate; with one setting it also records, for every round, how the verification
ended (k drafts accepted, then token r), whether r is in the drafter's draft vocabulary, and the
rank of r in the drafter's own distribution for that position: what a better drafter must fix.
Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from d3d.cli import add_model_args, model_config
from d3d.config import DecodeConfig
from d3d.decoding.stats import DecodeStats
from d3d.engine import Engine, decode
from d3d.worker import AsyncProposer, ServerConfig, ThreadWorker
from d3d.worker.protocol import Commit


def _decode_all(engine: Engine, worker, prompts: list[str], max_new: int) -> tuple[int, int]:
    hits = misses = 0
    for p in prompts:
        st = DecodeStats(mode="async")
        cfg = DecodeConfig(mode="async", max_new_tokens=max_new)
        proposer = AsyncProposer(worker, engine.target.vocab_size)
        for _ in decode(
            engine.target.model, proposer, engine.encode(p), cfg, engine.target.eos_token_ids, st
        ):
            pass
        hits, misses = hits + st.branch_hits, misses + st.branch_misses
    return hits, misses


def _outcome_log(engine: Engine, n: int, prompts: list[str], max_new: int) -> dict:
    """Per round: k, whether r is in the draft vocabulary, r's rank in q_{k+1}."""
    d = engine.drafter
    rows: list[tuple[int, bool, int | None]] = []
    worker = ThreadWorker(d, ServerConfig(fixed_branches=n))
    server = worker.server
    last: dict[int, object] = {}
    handle, prepare = server._commit, server._prepare

    def commit(msg: Commit, sess):
        blk = last.get(id(sess))
        if blk is not None:
            k, r = len(msg.tokens) - 1, msg.tokens[-1]
            inside = d.draft_index is None or int(d.draft_index[r]) >= 0
            rank = None
            if inside and k < len(blk.tokens):
                p = torch.softmax(blk.scores[k].float(), -1)
                ri = r if d.draft_index is None else int(d.draft_index[r])
                rank = int((p > p[ri]).sum())
            rows.append((k, inside, rank))
        yield from handle(msg, sess)

    def prep(sess, block, length):
        last[id(sess)] = block
        return prepare(sess, block, length)

    server._commit, server._prepare = commit, prep
    worker.wait_ready(30)
    _decode_all(engine, worker, prompts, max_new)
    worker.close()
    ranks = [r for _, _, r in rows if r is not None]
    return {
        "branches": n,
        "rounds": len(rows),
        "k": dict(collections.Counter(min(k, 3) for k, _, _ in rows)),
        "r_in_draft_vocabulary": round(sum(i for _, i, _ in rows) / max(len(rows), 1), 3),
        "rank_of_r": {
            "1-3": sum(1 for r in ranks if 1 <= r <= 3),
            "4-15": sum(1 for r in ranks if 4 <= r <= 15),
            ">=16": sum(1 for r in ranks if r >= 16),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eval.speed.hits", description=__doc__.splitlines()[0]
    )
    p.add_argument("--prompts", default="d3d/checkpoints/smollm2-135m/heldout_prompts.jsonl")
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--branches", default="1,2,4,8,16")
    p.add_argument("--out", default="runs/hits.json")
    add_model_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine.from_config(model_config(args))
    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines][: args.n]
    curve = []
    for n in [int(x) for x in args.branches.split(",")]:
        worker = ThreadWorker(engine.drafter, ServerConfig(fixed_branches=n))
        worker.wait_ready(30)
        h, m = _decode_all(engine, worker, prompts, args.max_new_tokens)
        worker.close()
        curve.append({"branches": n, "hit_rate": round(h / max(h + m, 1), 4), "rounds": h + m})
        print(json.dumps(curve[-1]), flush=True)
    out = {
        "command": "python -m eval.speed.hits " + " ".join(argv or []),
        "drafter": args.drafter or "default",
        "curve": curve,
        "outcomes": _outcome_log(engine, 8, prompts, args.max_new_tokens),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["outcomes"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
