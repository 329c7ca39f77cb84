"""``d3d data --engine vllm`` writes the records ``d3d data`` writes: the same prompts, the same
greedy response ids (the end id included), the same fields; a rerun resumes (and with nothing
left to write does not start vLLM); soft labels are refused with a message rather than silently
left out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from d3d.cli import main
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
NEW = 32  # five of the eight answers end on an end id before this many tokens, three reach it


def records(path) -> dict[str, dict]:
    return {r["id"]: r for r in read_jsonl(path)}


def d3d(*args: str) -> subprocess.CompletedProcess:
    """``d3d ARGS`` as a user runs it (vLLM's engine in a process of its own, not pytest's);
    vLLM's CPU KV cache 1 GiB, ample here (it is allocated whole at start)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "d3d", *args], capture_output=True, text=True, timeout=600, env=env
    )


def report_of(stdout: str) -> dict:
    """The command's JSON report (vLLM logs to stdout too)."""
    lines = [x for x in stdout.splitlines() if x.startswith('{"out"')]
    return json.loads(lines[-1])


def report(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stderr[-3000:]
    return report_of(run.stdout)


def test_vllm_writes_the_own_engines_records(tmp_path, capfd):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS))
    )
    common = ["data", "--prompts", str(prompts), "--max-new-tokens", str(NEW), "--quiet"]
    assert main([*common, "--out", str(tmp_path / "own.jsonl")]) == 0  # the own engine, here
    capfd.readouterr()
    run = d3d(*common, "--out", str(tmp_path / "vllm.jsonl"), "--engine", "vllm")
    made = report(run)
    assert "(EngineCore pid=" not in run.stdout + run.stderr  # on a CPU: in the command's process
    assert made["written"] == len(PROMPTS) and made["tokens_per_second"] > 0
    own, fast = records(tmp_path / "own.jsonl"), records(tmp_path / "vllm.jsonl")
    assert own.keys() == fast.keys() and len(own) == len(PROMPTS)
    for key, rec in own.items():
        assert fast[key] == rec, key  # every field: ids, split, text
    ended = [r for r in own.values() if len(r["response_ids"]) < NEW]
    assert ended, "no response ended on an end id: the end-id case is untested"
    # A rerun writes nothing new; soft labels are the own engine's. Neither starts an engine, so
    # both run in this process, through the same entry point (fd output: vLLM's processes too).
    assert main([*common, "--out", str(tmp_path / "vllm.jsonl"), "--engine", "vllm"]) == 0
    again = capfd.readouterr()
    assert report_of(again.out)["written"] == 0
    assert "EngineCore" not in again.out + again.err  # nothing left: vLLM never started
    topk = [*common, "--out", str(tmp_path / "k.jsonl"), "--engine", "vllm", "--keep-topk", "4"]
    assert main(topk) == 2 and "--keep-topk" in capfd.readouterr().err
