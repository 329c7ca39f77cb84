"""Online evaluation of a drafter: ``sync`` against ``ar`` greedy decoding on the same prompts.

Design: each prompt is decoded twice in the same process, ``ar`` then ``sync``, so both see the
same machine load; the report sums counters over prompts (acceptance length is total accepted
over total rounds, like vLLM's metric, not a mean of per-prompt means). ``lossless`` is true
only when every ``sync`` output equals its ``ar`` output token for token. Timings: drafter
block ms and target verify ms are per ``sync`` round; target step ms is per ``ar`` token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from d3d.config import DecodeConfig
from d3d.engine import Engine
from d3d.model.specs import DEFAULT_DRAFTER_DIR
from d3d.training.data import data_files

log = logging.getLogger(__name__)

HELDOUT_PROMPTS = DEFAULT_DRAFTER_DIR / "heldout_prompts.jsonl"


def read_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Prompts from a jsonl file with a ``prompt`` field (rows of a ``d3d data`` file work, and
    only their held-out split is used; a data path stands for its shards too) or from a file
    with one prompt per line."""
    files = data_files(path if path is not None else HELDOUT_PROMPTS)
    if not all(f.is_file() for f in files):
        raise FileNotFoundError(f"prompt file not found: {files[0]}")
    prompts = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            if not line.lstrip().startswith("{"):
                prompts.append(line)
                continue
            row = json.loads(line)
            if "prompt" not in row:
                raise ValueError(f"{f}:{i + 1}: jsonl prompt rows need a 'prompt' field")
            if row.get("split", "heldout") == "heldout":
                prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{files[0]} holds no prompts")
    return prompts[:limit] if limit else prompts


def evaluate(
    engine: Engine, prompts: Sequence[str], max_new_tokens: int = 128, progress: bool = True
) -> dict:
    """Decode every prompt with ``ar`` and ``sync`` (greedy); one summary dict."""
    if engine.drafter is None:
        raise ValueError("drafter-eval needs a drafter")
    b = engine.drafter.block_size
    drafts = accepted = 0
    per_pos = [0] * (b - 1)
    draft_s = verify_s = ar_s = sync_s = ar_step_s = 0.0
    ar_steps = tokens = 0
    lossless = True
    for prompt in tqdm(prompts, desc="drafter-eval", disable=not progress):
        ids = engine.encode(prompt)
        ar = engine.generate_ids(ids, DecodeConfig(mode="ar", max_new_tokens=max_new_tokens))
        sy = engine.generate_ids(
            ids, DecodeConfig(mode="sync", max_new_tokens=max_new_tokens, block_size=b)
        )
        lossless &= ar.token_ids == sy.token_ids
        s = sy.stats
        drafts += s.num_drafts
        accepted += s.num_accepted_tokens
        for i, c in enumerate(s.accepted_per_position):
            per_pos[i] += c
        draft_s += s.draft_seconds
        verify_s += s.verify_seconds
        sync_s += s.decode_seconds
        ar_s += ar.stats.decode_seconds
        ar_step_s += ar.stats.verify_seconds
        ar_steps += max(0, ar.stats.num_tokens - 1)
        tokens += s.num_tokens
    rounds = max(drafts, 1)
    return {
        "acceptance_length": round(1 + accepted / rounds, 4),
        "acceptance_per_position": [round(c / rounds, 4) for c in per_pos],
        "n_prompts": len(prompts),
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "num_tokens": tokens,
        "drafter_block_ms": round(1000 * draft_s / rounds, 2),
        "target_verify_ms": round(1000 * verify_s / rounds, 2),
        "target_step_ms": round(1000 * ar_step_s / max(ar_steps, 1), 2),
        "ar_seconds": round(ar_s, 3),
        "sync_seconds": round(sync_s, 3),
        "speedup_vs_ar": round(ar_s / sync_s, 4) if sync_s > 0 else 0.0,
        "lossless": lossless,
        "max_new_tokens": max_new_tokens,
    }
