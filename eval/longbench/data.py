"""LongBench items and where they come from.

An :class:`Item` is one LongBench record (``input``, ``context``, ``answers``, ``all_classes``,
``dataset``, ``_id``) plus three optional overrides used by the offline sets: the prompt template,
the generation length and the metric. Sources, tried in order by :func:`load_longbench`:

1. the Hugging Face dataset ``THUDM/LongBench`` through ``datasets`` (when the hub is reachable
   and ``source="hub"`` or ``"auto"``);
2. a local folder of LongBench jsonl files (``<task>.jsonl`` or any ``*.jsonl`` whose rows name
   their ``dataset``), by default ``../shared/longbench/sample`` beside the checkout.

The official prompt templates and generation lengths ship in ``eval/longbench/configs/`` (MIT,
THUDM/LongBench; licence file beside them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LOCAL = REPO_ROOT.parent / "shared" / "longbench" / "sample"
HUB_ID = "THUDM/LongBench"
# LongBench feeds these tasks as raw text: they are few-shot or code completion.
NO_CHAT_TEMPLATE = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")


@dataclass(frozen=True)
class Item:
    """One evaluation item (a LongBench record, or an offline one with overrides)."""

    id: str
    dataset: str
    input: str
    context: str
    answers: tuple[str, ...]
    all_classes: tuple[str, ...] | None = None
    language: str = "en"
    template: str | None = None
    max_new_tokens: int | None = None
    metric: str | None = None
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def task(self) -> str:
        return self.dataset.removesuffix("_e")

    @classmethod
    def from_record(cls, row: dict) -> Item:
        classes = row.get("all_classes")
        return cls(
            id=str(row.get("_id") or row.get("id")),
            dataset=str(row["dataset"]),
            input=str(row.get("input") or ""),
            context=str(row["context"]),
            answers=tuple(str(a) for a in row["answers"]),
            all_classes=tuple(classes) if classes else None,
            language=str(row.get("language") or "en"),
        )


@cache
def dataset2prompt() -> dict[str, str]:
    return json.loads((CONFIG_DIR / "dataset2prompt.json").read_text())


@cache
def dataset2maxlen() -> dict[str, int]:
    return json.loads((CONFIG_DIR / "dataset2maxlen.json").read_text())


def _per_dataset(item: Item, own, table: Callable[[], dict], what: str):
    """The item's own setting, else the official one for its task (``table`` read only then)."""
    if own is not None:
        return own
    try:
        return table()[item.task]
    except KeyError:
        raise ValueError(f"no LongBench {what} for dataset {item.dataset!r}") from None


def prompt_template(item: Item) -> str:
    return _per_dataset(item, item.template, dataset2prompt, "prompt")


def max_new_tokens(item: Item) -> int:
    return _per_dataset(item, item.max_new_tokens, dataset2maxlen, "generation length")


def uses_chat_template(item: Item) -> bool:
    return item.task not in NO_CHAT_TEMPLATE


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_local(folder: Path, datasets: Sequence[str] | None = None) -> list[Item]:
    """Items from every ``*.jsonl`` under ``folder`` (rows carry their ``dataset`` name)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"LongBench data folder not found: {folder}")
    items = [Item.from_record(r) for p in sorted(folder.glob("*.jsonl")) for r in read_jsonl(p)]
    if datasets:
        items = [it for it in items if it.dataset in datasets or it.task in datasets]
    if not items:
        raise FileNotFoundError(f"no LongBench rows for {list(datasets or [])} under {folder}")
    return items


def load_hub(datasets: Sequence[str]) -> list[Item]:
    """Items from ``THUDM/LongBench`` through ``datasets`` (raises when unreachable). No code of
    the dataset's repository runs (no ``trust_remote_code``: ``datasets`` >= 4 reads only data
    files); a hub copy that needs its loading script raises, and ``auto`` reads the local rows."""
    from datasets import load_dataset

    items: list[Item] = []
    for name in datasets:
        rows = load_dataset(HUB_ID, name, split="test")
        items.extend(Item.from_record(dict(r)) for r in rows)
    return items


def load_longbench(
    datasets: Sequence[str] | None = None,
    source: str = "auto",
    local: Path | None = None,
) -> list[Item]:
    """LongBench items from the hub (``hub``), a local folder (``local``), or hub-then-local."""
    if source not in ("auto", "hub", "local"):
        raise ValueError(f"source must be auto, hub or local, got {source!r}")
    if source in ("auto", "hub") and datasets:
        try:
            return load_hub(datasets)
        except Exception as exc:  # any hub/network failure falls back to local files
            if source == "hub":
                raise
            log.info("LongBench hub unreachable (%s); using local files", type(exc).__name__)
    return load_local(local or DEFAULT_LOCAL, datasets)


def take_per_dataset(items: Iterable[Item], limit: int | None) -> list[Item]:
    """The first ``limit`` items of each dataset, order kept (all when limit is None)."""
    seen: dict[str, int] = {}
    out = []
    for it in items:
        if limit is None or seen.get(it.dataset, 0) < limit:
            out.append(it)
            seen[it.dataset] = seen.get(it.dataset, 0) + 1
    return out
