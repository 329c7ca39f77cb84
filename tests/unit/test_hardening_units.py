"""The hardening pieces alone: the worker codec round-trips every message and builds nothing
else, private folders, the restart backoff, the document cache's file modes and leftovers, and
pinned hub ids."""

from __future__ import annotations

import os
import pickle
import stat

import numpy as np
import pytest
import torch

from app.watch import Restarts
from compression.doc_cache import DocumentCache
from d3d.config import ModelConfig, SamplingConfig
from d3d.engine.loading import DrafterFactory
from d3d.model.load import ModelLoadError, hub_source
from d3d.vllm.draft_fetch import DraftFlag
from d3d.worker import private
from d3d.worker.codec import CodecError
from d3d.worker.protocol import CODEC, Beat, Block, Close, Commit, Commits, Failed, Open, Ready
from d3d.worker.server import ServerConfig
from d3d.worker.workers import ChildStart


def test_every_message_round_trips():
    q = np.arange(6, dtype=np.int64).reshape(2, 3)
    msgs = [
        Open(1, [1, 2], SamplingConfig(temperature=0.5, stop_token_ids=(3,)), 7, False, False),
        Commits([Commit(1, [4], 0.01), Commit(2, [], 0.0, 0)]),
        Close(3), Beat(), Ready({"kind": "process", "cores": [1]}), Failed(None, "x"),
    ]  # fmt: skip
    for m in msgs:
        assert CODEC.decode(CODEC.encode(m)) == m
    b = CODEC.decode(CODEC.encode(Block(1, 5, [1], True, 3, 0.1, q, q.astype(np.float32))))
    assert isinstance(b, Block) and (b.q_ids == q).all() and b.q_probs.dtype == np.float32


def test_the_start_message_builds_project_dataclasses_only_where_asked():
    start = ChildStart(DrafterFactory(ModelConfig(target="t"), "cpu"), [1], None, ServerConfig(), 0.5, 10)  # fmt: skip
    data = CODEC.encode(start, start=True)
    assert CODEC.decode(data, start=True) == start
    with pytest.raises(CodecError):
        CODEC.decode(data)  # a reply can never carry a factory


def test_a_pickle_or_an_object_array_is_refused(tmp_path):
    class Marker:
        def __reduce__(self):
            return (open, (str(tmp_path / "m"), "w"))

    for bad in (pickle.dumps(Marker()), b"", b"\x93\x01\x02\x03"):
        with pytest.raises(CodecError):
            CODEC.decode(bad, start=True)
    with pytest.raises(CodecError):
        CODEC.encode(Block(1, 1, [], False, 0, 0.0, np.array([object()])))
    assert not (tmp_path / "m").exists()


def test_private_folders(tmp_path):
    folder = private.make()
    try:
        private.check(folder)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        private.remove(folder)
    assert not os.path.exists(folder)
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o755)
    (tmp_path / "link").symlink_to(tmp_path)
    for bad in ("open", "link", "missing"):
        with pytest.raises(private.NotPrivateError):
            private.check(str(tmp_path / bad))


def test_the_draft_flag_is_new_private_and_never_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (tmp_path / "flag").symlink_to(target)
    writer = DraftFlag(str(tmp_path / "flag"), writer=True)  # the stale link is replaced
    assert stat.S_IMODE(os.stat(tmp_path / "flag").st_mode) == 0o600
    assert target.read_bytes() == b"keep"
    writer.close()
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o755)
    with pytest.raises(private.NotPrivateError):
        DraftFlag(str(tmp_path / "open" / "flag"), writer=True)


def test_restarts_back_off_and_give_up():
    r = Restarts(backoff_s=1.0, max_backoff_s=3.0, stable_s=60.0, limit=4)
    assert [r.next_delay() for _ in range(5)] == [1.0, 2.0, 3.0, 3.0, None]


def test_the_document_cache_folder_and_files_are_private_and_leftovers_go(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o755)
    (folder / "k.999999999.1.tmp").write_bytes(b"half")  # a killed writer's (no such pid)
    (folder / f"k.{os.getpid()}.1.tmp").write_bytes(b"mine")  # a live writer's
    cache = DocumentCache(directory=folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.glob("*.tmp")) == [f"k.{os.getpid()}.1.tmp"]
    cache._write("abc", {"key": "abc", "x": torch.ones(2)})
    assert stat.S_IMODE((folder / "abc.pt").stat().st_mode) == 0o600
    cache._write("bad", {"key": "bad", "x": lambda: None})  # torch.save fails
    assert not (folder / "bad.pt").exists()
    assert len(list(folder.glob("*.tmp"))) == 1, "the failed write left nothing"


def test_hub_ids_may_pin_a_revision():
    assert hub_source("org/m@abc123") == ("org/m", {"revision": "abc123"})
    assert hub_source("org/m") == ("org/m", {})
    with pytest.raises(ModelLoadError):
        hub_source("org/m@")
