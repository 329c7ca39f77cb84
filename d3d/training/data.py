"""Training data for the drafter: records of the target's own responses, read and guarded.

Design:

- A drafter is judged by how often it guesses what *this target* says next, so the data is the
  target's own output, not a human reference: prompts (:mod:`.sources`) go through the chat
  template, the target answers greedily through the project's engine (:mod:`.responses`), and
  the response token ids are stored next to the prompt ids.
- A record (one jsonl line): ``id``, ``source``, ``split``, ``prompt``, ``prompt_ids``,
  ``response_ids``, ``text`` (and ``messages`` for a chat prompt, ``topk_ids`` /
  ``topk_logprobs`` for soft labels, ``teacher_forced`` for existing replies, ``eval_set`` for
  a record allowed in although it appears in an evaluation set).
- HumanEval, GSM8K, MT-Bench and AIME25 are evaluation sets (``EVAL_SOURCES``): the speed
  benchmarks report on them, so training refuses their records, and records whose prompt
  appears in one, unless asked (:func:`training_guard`).
- The held-out split is chosen by a hash of each prompt's id, so it is stable across runs and
  never depends on which other prompts are in the mix. Training also sets a few training
  records aside for validation (:func:`validation_split`), chosen the same way.
- Data files are appended to as responses finish; a run killed mid-line leaves a torn last
  line, which :func:`read_jsonl` (``repair=True``) drops so the rerun resumes cleanly.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
from collections.abc import Iterator, Sequence
from itertools import zip_longest
from pathlib import Path

log = logging.getLogger(__name__)

# What `d3d eval speed` reports on: never training data unless asked for and labelled.
EVAL_SOURCES = frozenset({"humaneval", "gsm8k", "mtbench", "aime25"})
# What every record carries (and ``text``, the decoded response, when generated).
RECORD_KEYS = frozenset({"id", "split", "prompt_ids", "response_ids"})
# A record trains when its response has a token with a next token (one block anchor).
MIN_RESPONSE_TOKENS = 2


def package_file(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install it)")
    path = Path(spec.origin).parent / rel
    if not path.is_file():
        raise FileNotFoundError(f"{package} has no {rel}")
    return path


def read_jsonl(path: Path, repair: bool = False) -> Iterator[dict]:
    """Rows of a jsonl file (gzipped when it ends in ``.gz``), streamed. ``repair``: a torn
    last line (a writer killed mid-line) is cut off the file instead of failing. A file that
    cannot be read, or a line that is not JSON, is a ValueError naming the file (and line)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    torn = not line.endswith("\n")  # only the last line can lack its newline
                    if not (repair and torn and path.suffix != ".gz"):
                        raise ValueError(f"{path}: line {i} is not JSON ({exc.msg})") from None
                    log.warning("%s: dropping a torn last line (%d bytes)", path, len(line))
                    with path.open("r+b") as w:
                        w.truncate(path.stat().st_size - len(line.encode("utf-8")))
                    return
                yield row
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (it is not UTF-8)") from None
    except (OSError, EOFError) as exc:  # no permission, not gzip, a truncated gzip stream
        raise ValueError(
            f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})"
        ) from None


def is_heldout(prompt_id: str, fraction: float) -> bool:
    """Stable split: the prompt's id hashed to [0, 1)."""
    h = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def data_files(path: str | Path) -> list[Path]:
    """The files a data path stands for: the file, and the shards ``d3d data --shard`` wrote
    beside it (``NAME.shard-i-of-n.jsonl``)."""
    p = Path(path)
    shards = sorted(p.parent.glob(f"{p.stem}.shard-*-of-*{p.suffix}"))
    return ([p] if p.is_file() or not shards else []) + shards


def read_many(paths: str | Path | Sequence[str | Path], split: str | None = None) -> list[dict]:
    """Records of one or more data paths (each a file and its shards, :func:`data_files`), in
    order (see :func:`read_records`)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    return [r for p in paths for f in data_files(p) for r in read_records(f, split)]


def training_guard(records: Sequence[dict], allow_eval: bool = False) -> list[dict]:
    """The records, refusing evaluation-set sources, and records whose prompt appears in an
    evaluation set (``eval_set``), unless ``allow_eval``: the speed benchmarks report on those
    sets, and a drafter trained on their items inflates the figures."""
    bad = sorted({str(r.get("source")) for r in records if r.get("source") in EVAL_SOURCES})
    bad += sorted({f"prompts in {r['eval_set']}" for r in records if r.get("eval_set")})
    if bad and not allow_eval:
        raise ValueError(
            f"training data holds evaluation-set records ({', '.join(bad)}): drop them, or pass "
            "--allow-eval-sources and label the result"
        )
    return list(records)


def read_records(path: str | Path, split: str | None = None) -> list[dict]:
    """Records of a data file, optionally only one split (``train`` or ``heldout``). A file
    with no record, or a row that is not a record, is a ValueError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    rows = list(read_jsonl(p))
    if not rows:
        raise ValueError(f"{p}: no records (the file is empty); write some with `d3d data`")
    for i, r in enumerate(rows, 1):
        if not (isinstance(r, dict) and r.keys() >= RECORD_KEYS):
            raise ValueError(
                f"{p}: record {i} is not a `d3d data` record (it needs {', '.join(sorted(RECORD_KEYS))})"
            )
    return [r for r in rows if split is None or r["split"] == split]


def validation_split(records: Sequence[dict], n: int) -> tuple[list[dict], list[dict]]:
    """Set ``n`` training records aside for validation (chosen by a hash of their ids, so the
    choice is stable): returns (train, val)."""
    key = {r["id"]: hashlib.sha256(f"val/{r['id']}".encode()).hexdigest() for r in records}
    val_ids = set(sorted(key, key=key.get)[:n])
    return [r for r in records if r["id"] not in val_ids], [
        r for r in records if r["id"] in val_ids
    ]


def draft_vocabulary(records: Sequence[dict], size: int, always: Sequence[int] = ()) -> list[int]:
    """The ``size`` target tokens most frequent in the records' responses (ties by id), plus
    ``always`` (e.g. end-of-sequence ids); sorted. A drafter restricted to them only proposes
    what the target actually says (see :meth:`d3d.model.drafter.D3DDrafter.set_draft_vocab`)."""
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    counts: dict[int, int] = {}
    for r in records:
        for t in r["response_ids"]:
            counts[int(t)] = counts.get(int(t), 0) + 1
    keep = {int(t) for t in always}
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        keep.add(t)
    return sorted(keep)


def write_heldout_prompts(data_path: str | Path, out_path: str | Path) -> int:
    """Write the held-out prompts of a data file as jsonl (``id``, ``source``, ``prompt``), the
    sources interleaved — the default prompt set of ``d3d drafter-eval``. Returns how many."""
    rows = read_records(data_path, "heldout")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    by_source: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["id"]):
        by_source.setdefault(r["source"], []).append(r)
    # Round-robin over sources, so the first N prompts (--limit N) still mix them.
    order = [r for group in zip_longest(*by_source.values()) for r in group if r is not None]
    with out.open("w", encoding="utf-8") as f:
        for r in order:
            f.write(
                json.dumps({"id": r["id"], "source": r["source"], "prompt": r["prompt"]}) + "\n"
            )
    return len(rows)
