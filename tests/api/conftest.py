"""Live servers on loopback for the API tests: uvicorn in a thread, real sockets, real clients.

``live`` serves the embedded default model (SmolLM2-135M and its drafter), loaded once per test
session. ``tiny`` serves a tiny random model (milliseconds per token) for tests that need
unusual settings: an API key, a small queue, a short timeout, schemathesis's thousands of calls.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from app.main import create_app
from app.settings import ServeSettings
from d3d.config import ModelConfig
from d3d.engine import Engine
from d3d.model.load import LoadedModel
from tests.conftest import tiny_model, tiny_tokenizer


@dataclass
class Live:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def worker(self):
        return self.app.state.worker

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(settings: ServeSettings, engine_factory=None, ready_timeout: float = 600.0) -> Live:
    app = create_app(settings, engine_factory) if engine_factory else create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    deadline = time.time() + ready_timeout
    while time.time() < deadline:
        try:
            r = httpx.get(url + "/ready", timeout=5)
            if r.status_code == 200:
                return Live(url, app, server, thread)
            if r.json().get("status") == "failed":
                raise RuntimeError(r.text)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def tiny_engine(settings) -> Engine:
    model = tiny_model("llama", seed=1, window=512)
    loaded = LoadedModel(model=model, tokenizer=tiny_tokenizer(), spec="tiny")
    return Engine(loaded, None, settings.model)


@pytest.fixture(scope="session")
def live():
    settings = ServeSettings(
        model=ModelConfig(threads=2),
        port=free_port(),
        max_document_tokens=3000,
        max_body_bytes=2_000_000,
    )
    srv = start(settings)
    yield srv
    srv.stop()


def tiny_server(**overrides) -> Live:
    overrides.setdefault("model", ModelConfig(target="tiny"))
    settings = ServeSettings(port=free_port(), served_model_name="tiny", **overrides)
    return start(settings, tiny_engine)


def folder_server(folder, name: str) -> Live:
    """A server on the model saved in ``folder`` (a Qwen3 made for the tests), its layers as
    the drafter (``self:1``)."""
    from d3d.engine import build_drafter
    from d3d.model.load import load_target

    def engine(_settings) -> Engine:
        target = load_target(str(folder))
        return Engine(target, build_drafter("self:1", target))

    settings = ServeSettings(
        model=ModelConfig(target=str(folder)),
        port=free_port(),
        served_model_name=name,
        request_timeout=60.0,
    )
    return start(settings, engine)


@pytest.fixture(scope="module")
def tiny():
    srv = tiny_server(max_queue=2, request_timeout=5.0)
    yield srv
    srv.stop()
