"""The flag by which vLLM's engine core skips empty draft round trips (no vLLM needed: the
engine core is a stand-in with the attributes the wrapper reads)."""

from __future__ import annotations

from types import SimpleNamespace

from d3d.vllm import draft_fetch
from d3d.vllm.draft_fetch import DraftFlag, flag_for, skip_empty
from d3d.vllm.engine import PROPOSER


def test_the_reader_sees_each_value_the_writer_sets(tmp_path):
    path = str(tmp_path / "flag")
    reader = DraftFlag(path)
    assert reader.drafted(), "no file yet: the round trip happens"
    writer = DraftFlag(path, writer=True)
    assert reader.drafted(), "a new flag says drafted until the first step"
    writer.set(False)
    assert not reader.drafted()
    writer.set(True)
    assert reader.drafted()
    writer.close()
    assert not (tmp_path / "flag").exists()
    reader.close()
    assert DraftFlag(path).drafted(), "gone: the round trip happens again"


def core(method="custom_class", model=PROPOSER, dp=1, async_scheduling=False):
    spec = SimpleNamespace(method=method, model=model)
    cfg = SimpleNamespace(
        speculative_config=spec, parallel_config=SimpleNamespace(data_parallel_size=dp)
    )
    return SimpleNamespace(vllm_config=cfg, async_scheduling=async_scheduling)


def test_post_step_skips_the_round_trip_only_after_a_step_without_drafts(tmp_path, monkeypatch):
    path = str(tmp_path / "flag")
    monkeypatch.setenv(draft_fetch.ENV, path)
    writer = DraftFlag(path, writer=True)
    c = core()
    assert not skip_empty(c, True), "drafted (the flag's first value): vLLM's post_step runs"
    writer.set(False)
    assert skip_empty(c, True), "no drafts: skipped"
    assert not skip_empty(c, False), "no model step: vLLM's post_step runs"
    writer.set(True)
    assert not skip_empty(c, True)
    writer.close()


def test_other_engines_keep_vllms_post_step(tmp_path, monkeypatch):
    monkeypatch.setenv(draft_fetch.ENV, str(tmp_path / "flag"))
    assert flag_for(core()) is not None
    assert flag_for(core(method="ngram", model="ngram")) is None
    assert flag_for(core(model="someone.Else")) is None
    assert flag_for(core(dp=2)) is None
    assert flag_for(core(async_scheduling=True)) is None
    c = core()
    c.vllm_config.speculative_config = None
    assert flag_for(c) is None
    monkeypatch.delenv(draft_fetch.ENV)
    assert flag_for(core()) is None
    assert not skip_empty(core(), True), "no flag: every round trip happens"
