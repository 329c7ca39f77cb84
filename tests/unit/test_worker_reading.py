"""Documents read in the drafter worker (:mod:`d3d.worker.reading`, :mod:`app.documents`).

The socket first, with readers made here (plain fields, built in the serving process): a round
trip, a failing reading, a reader that cannot be built, a folder others may enter, a worker
replaced under a client. Then the service's reader in a real drafter worker process, a tiny
target and its ``self:1`` drafter: the kept prompt it sends back is the own engine's, and its
refusals are the same exceptions (413 for a document over the limit, 422 for a scorer).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import pytest

from app.documents import Documents, RemoteDocuments, WorkerReader
from d3d.config import ModelConfig
from d3d.engine import Engine
from d3d.engine.loading import DrafterFactory
from d3d.worker import private
from d3d.worker.codec import import_name
from d3d.worker.reading import ReadClient, ReaderSpec, ReadServer
from d3d.worker.workers import ProcessWorker
from tests.conftest import tiny_model, tiny_tokenizer


@dataclass(frozen=True)
class EchoReader:
    """A reader of plain fields: echoes ``args["text"]`` after ``prefix``; ``boom`` raises."""

    prefix: str

    def __call__(self, drafter):
        def read(args: dict) -> dict:
            if args.get("boom"):
                raise RuntimeError("the reading broke")
            return {"echo": self.prefix + args["text"], "drafter": drafter}

        return read


@dataclass(frozen=True)
class BrokenReader:
    def __call__(self, drafter):
        raise OSError("no tokenizer here")


@pytest.fixture
def folder():
    path = private.make()
    yield path
    private.remove(path)


def spec(cls: type, fields: dict, folder: str) -> ReaderSpec:
    return ReaderSpec(import_name(cls), fields, os.path.join(folder, "read.sock"))


def test_a_reading_crosses_the_socket_and_a_failure_comes_back_as_its_reason(folder):
    server = ReadServer(spec(EchoReader, {"prefix": "> "}, folder), drafter="d0")
    client = ReadClient(server.spec.path, timeout=10)
    assert client.read({"text": "hello"}) == {"echo": "> hello", "drafter": "d0"}
    assert client.read({"text": "x" * 3_000_000})["echo"] == "> " + "x" * 3_000_000
    out = client.read({"text": "", "boom": True})
    assert out == {"error": "RuntimeError", "message": "the reading broke"}
    assert client.read({"text": "again"})["echo"] == "> again"  # the connection survives
    client.close()
    server.close()


def test_a_reader_that_cannot_be_built_answers_why(folder):
    server = ReadServer(spec(BrokenReader, {}, folder), drafter=None)
    out = ReadClient(server.spec.path, timeout=10).read({})
    assert out["error"] == "RuntimeError"
    assert "cannot read documents: OSError: no tokenizer here" in out["message"]
    server.close()


def test_only_the_projects_frozen_dataclasses_build_readers(folder):
    server = ReadServer(ReaderSpec("os:system", {}, os.path.join(folder, "r.sock")), None)
    out = ReadClient(server.spec.path, timeout=10).read({})
    assert "is not a class of this project" in out["message"]
    server.close()


def test_a_folder_others_may_enter_is_refused():
    shared = tempfile.mkdtemp()
    os.chmod(shared, 0o777)
    try:
        with pytest.raises(private.NotPrivateError):
            ReadServer(spec(EchoReader, {"prefix": ""}, shared), None)
        os.chmod(shared, 0o700)
        server = ReadServer(spec(EchoReader, {"prefix": ""}, shared), None)
        os.chmod(shared, 0o777)
        with pytest.raises(private.NotPrivateError):
            ReadClient(server.spec.path, timeout=5).read({"text": "x"})
        server.close()
    finally:
        os.chmod(shared, 0o700)
        private.remove(shared)


def test_a_replaced_worker_is_reached_again_and_a_missing_one_is_a_connection_error(folder):
    first = ReadServer(spec(EchoReader, {"prefix": "1:"}, folder), None)
    client = ReadClient(first.spec.path, timeout=10)
    assert client.read({"text": "a"})["echo"] == "1:a"
    first.close()
    with pytest.raises(ConnectionError, match="not up to read"):
        client.read({"text": "b"})
    second = ReadServer(spec(EchoReader, {"prefix": "2:"}, folder), None)
    assert client.read({"text": "c"})["echo"] == "2:c"
    second.close()


# ----- the service's reader in a drafter worker process --------------------------------------
DOC = " ".join(f"w{5 + i % 40}" for i in range(300))
QUESTION = "w7 w9 w11"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("reading") / "m"
    tiny_model("llama", seed=1).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def test_the_drafter_worker_reads_the_own_engines_kept_prompt(target, folder):
    cfg = ModelConfig(target=target, drafter="self:1")
    reader = spec(WorkerReader, {"target": target}, folder)
    worker = ProcessWorker(DrafterFactory(cfg), None, reader=reader)
    try:
        assert worker.wait_ready(120), worker.why
        remote = RemoteDocuments(ReadClient(reader.path, timeout=60), tiny_tokenizer())
        own = Documents.for_engine(Engine.from_config(cfg))
        for scorer in ("auto", "drafter", "drafter-match", "bm25"):
            got = remote.prepare(DOC, QUESTION, 0.2, scorer, 4000)
            want = own.prepare(DOC, QUESTION, 0.2, scorer, 4000)
            assert got.prompt_ids == want.prompt_ids, scorer
            assert got.info["kept_spans"] == want.info["kept_spans"], scorer
            assert got.info["scorer"] == want.info["scorer"], scorer
        with pytest.raises(ValueError, match="limit is 100 tokens") as too_large:
            remote.prepare(DOC, QUESTION, 0.2, "auto", 100)
        assert type(too_large.value).__name__ == "DocumentTooLarge"
        with pytest.raises(ValueError, match="unknown scorer"):
            remote.prepare(DOC, QUESTION, 0.2, "nope", 4000)
        with pytest.raises(ValueError, match="the question is empty"):
            remote.prepare(DOC, " ", 0.2, "auto", 4000)
    finally:
        worker.close()
