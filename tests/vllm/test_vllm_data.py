"""``d3d data --engine vllm`` writes the records ``d3d data`` writes: the same prompts, the same
greedy response ids (the end id included), the same fields; a rerun resumes (and with nothing
left to write does not start vLLM); soft labels are refused with a message rather than silently
left out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from d3d.training.data import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
PROMPTS = [
    "List three colours.",
    "What is two plus two?",
    "Name a large animal.",
    "Say hello in French.",
    "Write one word that rhymes with cat.",
    "What is the capital of Italy?",
    "Count from one to five.",
    "Describe the sea in one sentence.",
]


def records(path) -> dict[str, dict]:
    return {r["id"]: r for r in read_jsonl(path)}


def d3d(*args: str) -> subprocess.CompletedProcess:
    """``d3d ARGS`` as a user runs it (vLLM's engine in a process of its own, not pytest's)."""
    return subprocess.run(
        [sys.executable, "-m", "d3d", *args], capture_output=True, text=True, timeout=600
    )


def report(run: subprocess.CompletedProcess) -> dict:
    """The command's JSON report (vLLM logs to stdout too)."""
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [x for x in run.stdout.splitlines() if x.startswith('{"out"')]
    return json.loads(lines[-1])


def test_vllm_writes_the_own_engines_records(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS))
    )
    common = ["data", "--prompts", str(prompts), "--max-new-tokens", "48", "--quiet"]
    report(d3d(*common, "--out", str(tmp_path / "own.jsonl")))
    made = report(d3d(*common, "--out", str(tmp_path / "vllm.jsonl"), "--engine", "vllm"))
    assert made["written"] == len(PROMPTS) and made["tokens_per_second"] > 0
    own, fast = records(tmp_path / "own.jsonl"), records(tmp_path / "vllm.jsonl")
    assert own.keys() == fast.keys() and len(own) == len(PROMPTS)
    for key, rec in own.items():
        assert fast[key] == rec, key  # every field: ids, split, text
    ended = [r for r in own.values() if len(r["response_ids"]) < 48]
    assert ended, "no response ended on an end id: the end-id case is untested"
    # A rerun writes nothing new; soft labels are the own engine's.
    again = d3d(*common, "--out", str(tmp_path / "vllm.jsonl"), "--engine", "vllm")
    assert report(again)["written"] == 0
    assert "EngineCore" not in again.stdout + again.stderr  # nothing left: vLLM never started
    topk = d3d(*common, "--out", str(tmp_path / "k.jsonl"), "--engine", "vllm", "--keep-topk", "4")
    assert topk.returncode == 2 and "--keep-topk" in topk.stderr
