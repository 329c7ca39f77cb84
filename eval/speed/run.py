"""``d3d eval speed``'s sweep: every method on every request, interleaved, appended as it goes.

For each request (a benchmark prompt; MT-Bench's second turn is asked after the target's own
first answer) the methods run back to back, so slow drifts of a shared machine hit all of them
alike; each finished (request, method) is one JSON line in ``OUT/records.jsonl``, and a rerun of
the same command skips what is there (resumable). Before timing, every method decodes one short
warm-up request. Each record says whether its tokens equal ``ar``'s for the same request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from d3d.engine import Engine
from d3d.model.load import encode_messages
from eval.speed.methods import METHODS, run_method
from eval.speed.prompts import load_items

log = logging.getLogger(__name__)
RECORDS = "records.jsonl"
REFERENCE = "ar-1t"


@dataclass(frozen=True)
class SpeedConfig:
    benchmarks: tuple[str, ...]
    n: int
    methods: tuple[str, ...]
    max_new_tokens: int

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}: use {', '.join(METHODS)}")
        if REFERENCE not in self.methods:
            raise ValueError(f"methods must include {REFERENCE} (the reference output)")
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("n and max_new_tokens must be >= 1")


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_speed(engine: Engine, cfg: SpeedConfig, out: Path, progress: bool = True) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS
    records = read_records(path)
    done = {(r["request"], r["method"]) for r in records}
    refs = [r for r in records if r["method"] == REFERENCE]
    answers = {r["request"]: r["text"] for r in refs}
    ref_ids = {r["request"]: r["token_ids"] for r in refs}
    items = [it for b in cfg.benchmarks for it in load_items(b, cfg.n)]
    requests = [(it, turn) for it in items for turn in range(len(it.turns))]
    methods = [REFERENCE, *[m for m in cfg.methods if m != REFERENCE]]
    todo = sum(1 for it, t in requests for m in methods if (f"{it.item_id}#{t}", m) not in done)
    if todo:
        _warm_up(engine, methods)
    bar = tqdm(total=todo, desc="eval speed", unit="run", disable=not progress)
    tok = engine.tokenizer
    with path.open("a") as f:
        for item, turn in requests:
            rid = f"{item.item_id}#{turn}"
            messages = [{"role": "user", "content": item.turns[0]}]
            if turn == 1:
                first = answers.get(f"{item.item_id}#0")
                if first is None:
                    continue
                messages += [
                    {"role": "assistant", "content": first},
                    {"role": "user", "content": item.turns[1]},
                ]
            ids = encode_messages(tok, messages)
            for m in methods:
                if (rid, m) in done:
                    continue
                rec = run_method(engine, METHODS[m], ids, cfg.max_new_tokens)
                token_ids = rec.pop("token_ids")
                if m == REFERENCE:
                    ref_ids[rid] = token_ids
                    answers[rid] = tok.decode(token_ids, skip_special_tokens=True)
                rec.update(
                    request=rid,
                    benchmark=item.benchmark,
                    turn=turn,
                    prompt_tokens=len(ids),
                    identical=token_ids == ref_ids[rid] if rid in ref_ids else None,
                    token_ids=token_ids,
                    text=answers[rid] if m == REFERENCE else None,
                )
                records.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                bar.update(1)
    bar.close()
    return records


def _warm_up(engine: Engine, methods: list[str]) -> None:
    ids = engine.encode("Say hello.")
    for m in methods:
        run_method(engine, METHODS[m], ids, 8)
