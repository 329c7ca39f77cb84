"""The sweep: items x keep ratios x scorers x decode modes, timed per stage, resumable.

Every run of one item under one setting appends one JSON line to ``records.jsonl``:
the prediction, its score, the token counts, and the seconds spent tokenising, compressing
(segmentation, scoring and selection), in the target's prefill and in decoding, plus
``total_s`` = their sum, as :class:`compression.qa.Timings` defines it for ``d3d qa`` and the
service. Keep ratio 1.0 is the full prompt, run once per item and mode under the scorer name
``full``. Compressors come from one :class:`compression.qa.DocumentQA` (built once); its
document cache is emptied before each scorer reads an item, so every scorer pays its own
document pass.

Order: for each item, the full prompt and then every scorer at the smallest keep ratio; then the
remaining keep ratios, item by item. So a partial run already pairs every item's full prompt with
the most compressed one. Each scorer reads an item once; its time is charged to every keep ratio
it serves (the same work would be done per request). A restarted run skips the lines already in
the file. ``budget_s`` stops a run between records after that many seconds (resume later).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compression.compressor import DEFAULT_SCORER, CompressionConfig, ContextScores
from compression.doc_cache import DocumentCache
from compression.prompt import PromptParts
from compression.qa import DocumentQA, Timings
from compression.selection import check_keep_ratio
from compression.units import Chunk
from d3d.backends.sizes import UNSTATED_WINDOW
from d3d.backends.sizes import window as model_window
from d3d.config import MODES, DecodeConfig
from d3d.engine import Engine
from eval.longbench import metrics
from eval.longbench.data import Item, max_new_tokens
from eval.longbench.prompts import item_parts, window_budget

log = logging.getLogger(__name__)

FULL = "full"
RECORDS = "records.jsonl"
DEFAULT_MODE = "auto" if "auto" in MODES else "ar"


@dataclass(frozen=True)
class SweepConfig:
    """What to run; ``compression`` carries the scorer settings (its scorer/keep are ignored)."""

    keep_ratios: tuple[float, ...] = (1.0, 0.5, 0.2, 0.1, 0.05)
    scorers: tuple[str, ...] = (DEFAULT_SCORER, "drafter-attention", "bm25", "head-tail", "random")
    modes: tuple[str, ...] = (DEFAULT_MODE,)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    max_length: int | None = None
    max_new_tokens: int | None = None  # cap on the tasks' generation lengths

    def __post_init__(self) -> None:
        if not self.keep_ratios:
            raise ValueError("a sweep needs at least one keep ratio")
        for k in self.keep_ratios:
            check_keep_ratio(k)
        if not self.scorers or not self.modes:
            raise ValueError("a sweep needs at least one scorer and one mode")
        for s in self.scorers:
            CompressionConfig(scorer=s)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def record_key(item_id: str, scorer: str, keep: float, mode: str) -> str:
    return f"{item_id}|{scorer}|{keep:g}|{mode}"


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("skipping a torn line in %s", path)
    return out


def item_metric(item: Item) -> metrics.Metric:
    return getattr(metrics, item.metric) if item.metric else metrics.metric_for(item.dataset)


def schedule(cfg: SweepConfig) -> list[list[float]]:
    """Keep-ratio passes: [1.0 and the smallest], then the others from small to large."""
    ratios = sorted({k for k in cfg.keep_ratios if k < 1.0})
    first = ([1.0] if 1.0 in cfg.keep_ratios else []) + ratios[:1]
    return [p for p in [first, *[[k] for k in ratios[1:]]] if p]


class Sweep:
    """Runs a :class:`SweepConfig` over items with one engine, appending to ``out/records.jsonl``."""

    def __init__(self, engine: Engine, cfg: SweepConfig, out: Path, target_spec: str | None = None):
        self.engine = engine
        self.cfg = cfg
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / RECORDS
        self.done = {
            record_key(r["item"], r["scorer"], r["keep_ratio"], r["mode"])
            for r in read_records(self.path)
        }
        self.qa = DocumentQA(
            engine, cfg.compression, DocumentCache(max_entries=1), target_spec=target_spec
        )
        for name in cfg.scorers:  # build every compressor (and the reader) up front
            self.qa.compressor(name)
        self._scores: dict[tuple[str, str], ContextScores] = {}

    def window(self) -> int:
        return model_window(self.engine.target.model.config) or UNSTATED_WINDOW

    def parts(self, item: Item) -> tuple[PromptParts, float]:
        """The item's prompt parts and the seconds tokenising took."""
        limit = window_budget(self.window(), item)
        if self.cfg.max_length:
            limit = min(limit, self.cfg.max_length)
        t0 = time.perf_counter()
        parts = item_parts(item, self.engine.tokenizer, limit)
        return parts, time.perf_counter() - t0

    def tasks(self, items: Sequence[Item]) -> Iterator[tuple[Item, str, float, str]]:
        for ratios in schedule(self.cfg):
            for item in items:
                for keep in ratios:
                    for mode in self.cfg.modes:
                        for scorer in [FULL] if keep == 1.0 else self.cfg.scorers:
                            if record_key(item.id, scorer, keep, mode) not in self.done:
                                yield item, scorer, keep, mode

    def run(
        self, items: Sequence[Item], progress: Callable | None = None, budget_s: float | None = None
    ) -> int:
        """Run everything not yet in the records file (or until ``budget_s`` seconds have
        passed); returns the number of new records."""
        todo = list(self.tasks(items))
        bar = progress(total=len(todo)) if progress else None
        parts_cache: dict[str, tuple[PromptParts, float]] = {}
        start = time.perf_counter()
        n = 0
        for item, scorer, keep, mode in todo:
            if budget_s is not None and time.perf_counter() - start > budget_s:
                log.warning("time budget of %.0f s spent: stopping (rerun to resume)", budget_s)
                break
            if item.id not in parts_cache:
                parts_cache = {item.id: self.parts(item)}
            parts, tokenize_s = parts_cache[item.id]
            rec = self.run_one(item, parts, scorer, keep, mode, tokenize_s)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            self.done.add(record_key(item.id, scorer, keep, mode))
            n += 1
            if bar is not None:
                bar.set_postfix_str(f"{item.dataset} {scorer} {keep:g} {rec['total_s']:.1f}s")
                bar.update(1)
        if bar is not None:
            bar.close()
        return n

    def scores(self, item: Item, parts: PromptParts, scorer: str) -> ContextScores:
        """An item's scores under a scorer, computed once per sweep folder: they are saved under
        ``OUT/scores/`` with their measured seconds, so a resumed run or the next keep-ratio
        pass does not read the item again (and charges the same seconds)."""
        key = (item.id, scorer)
        if key in self._scores:
            return self._scores[key]
        path = (
            self.out / "scores" / (hashlib.sha1(f"{item.id}|{scorer}".encode()).hexdigest() + ".pt")
        )
        if path.is_file():
            saved = torch.load(path, weights_only=True)  # tensors, numbers, lists only
            got = ContextScores(
                saved["scores"], saved["seconds"], tuple(Chunk(*u) for u in saved["units"])
            )
        else:
            self.qa.cache.clear()  # each scorer pays its own document pass
            got = self.qa.compressor(scorer).score(parts)
            path.parent.mkdir(exist_ok=True)
            units = [(u.start, u.end, u.mid_sentence) for u in got.units]
            torch.save({"scores": got.scores, "seconds": got.seconds, "units": units}, path)
        self._scores = {k: v for k, v in self._scores.items() if k[0] == item.id}
        self._scores[key] = got
        return got

    def run_one(
        self,
        item: Item,
        parts: PromptParts,
        scorer: str,
        keep: float,
        mode: str,
        tokenize_s: float = 0.0,
    ) -> dict:
        tok = self.engine.tokenizer
        if scorer == FULL:
            kept, compress_s, kept_idx = parts, 0.0, range(len(parts.context))
        else:
            comp = self.qa.compressor(scorer).select(parts, self.scores(item, parts, scorer), keep)
            kept, compress_s, kept_idx = comp.parts, comp.seconds, comp.kept
        new = max_new_tokens(item)
        if self.cfg.max_new_tokens:
            new = min(new, self.cfg.max_new_tokens)
        dcfg = DecodeConfig(mode=mode, max_new_tokens=new)
        t0 = time.perf_counter()
        gen = self.engine.generate_ids(kept.ids, dcfg)
        wall = time.perf_counter() - t0
        st = gen.stats
        timings = Timings(tokenize_s, compress_s, st.prefill_seconds, st.decode_seconds)
        score = metrics.score_item(
            item.dataset, gen.text, item.answers, item.all_classes, item_metric(item)
        )
        cut = len(kept_idx) < len(parts.context)
        kept_text = tok.decode(kept.context) if cut else None
        full_text = tok.decode(parts.context) if cut else None
        return {
            "item": item.id,
            "dataset": item.dataset,
            "scorer": scorer,
            "keep_ratio": keep,
            "mode": mode,
            "score": score,
            "prediction": gen.text,
            "answers": list(item.answers),
            "total_tokens": len(parts),
            "kept_tokens": len(kept),
            "new_tokens": len(gen.token_ids),
            **timings.to_dict(),
            "generate_wall_s": round(wall, 4),
            "evidence_kept": evidence_kept(item, kept_text, full_text),
            "speculative": st.to_dict(),
        }


def evidence_kept(item: Item, kept_text: str | None, full_text: str | None = None) -> bool | None:
    """Whether the kept context still holds the needle sentence whole, or a gold answer string.

    None: nothing was cut, or (given ``full_text``) the full context holds no gold answer
    string either, so there is no evidence to keep."""
    if kept_text is None:
        return None
    if "needle" in item.meta:  # whole, case and spacing aside (a fact may open a sentence)
        return " ".join(item.meta["needle"].split()).lower() in " ".join(kept_text.split()).lower()
    answers = [a.lower() for a in item.answers if a.strip()]
    if full_text is not None and not any(a in full_text.lower() for a in answers):
        return None
    low = kept_text.lower()
    return any(a in low for a in answers)
