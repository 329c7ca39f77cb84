"""Stopping, failing and the sockets, tried on purpose against live servers over real sockets.

- SIGTERM under streaming clients (the service in a process of its own, as ``d3d serve`` runs
  it): every stream runs to its end, new requests and ``/ready`` get 503 with ``Retry-After``,
  the process exits within the drain deadline, its drafter worker process is gone, and it leaves
  no temporary folder.
- A failure that escapes the engine loop: the waiting request gets 503 at once, ``/ready`` says
  ``restarting``, then the service answers as before; a failure that keeps coming back fails
  the service (``/ready`` 503 ``failed``) and calls its exit hook.
- Pickles sent to each socket (the vLLM proposer's statistics socket, and both ends of the
  drafter worker's socket pair) build nothing: no marker file, a clean refusal.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import pytest

from d3d.vllm.stats import StatsClient, StatsServer
from d3d.worker import private
from d3d.worker.protocol import Beat, Ready
from d3d.worker.workers import WorkerClient, available_cores, recv, send
from tests.api.conftest import free_port, tiny_server
from tests.api.test_faults import slowed
from tests.conftest import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


class Marker:
    """A pickle that, if ever loaded, creates a file (``os.system`` would do worse)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def chat(prompt: str, max_tokens: int, mode: str = "ar", stream: bool = False) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": stream, "speculative": {"mode": mode}}  # fmt: skip


# ----- SIGTERM -------------------------------------------------------------------------------
def _stream(url: str, body: dict, first: threading.Event, out: dict) -> None:
    text, finish, done = "", None, False
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("delta", {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
                first.set()
    out.update(text=text, finish=finish, done=done)


def _wait_ready(url: str, proc: subprocess.Popen, within: float) -> dict:
    end = time.time() + within
    while time.time() < end:
        assert proc.poll() is None, "the server exited while starting"
        try:
            r = httpx.get(url + "/ready", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become ready")


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores")
def test_sigterm_finishes_every_stream_refuses_new_ones_and_leaves_nothing(tmp_path):
    folder, tmp = tmp_path / "m", tmp_path / "tmp"
    tmp.mkdir()
    tiny_model("llama", seed=1).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    port, drain = free_port(), 40.0
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.api.lifecycle_server", str(folder), str(port), str(drain)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        _wait_ready(url, proc, 180)
        prompts = [f"w{3 + i} w{11 + i}" for i in range(6)]
        alone = [
            httpx.post(url + "/v1/chat/completions", json=chat(p, 60), timeout=120).json()
            for p in prompts[:2]
        ]
        drafted = httpx.post(
            url + "/v1/chat/completions", json=chat("w5 w6", 8, "async"), timeout=60
        )
        assert drafted.status_code == 200, drafted.text
        end = time.time() + 60
        while not (
            (worker := httpx.get(url + "/ready", timeout=5).json()["drafter_worker"]) or {}
        ).get("pid"):
            assert time.time() < end, "the drafter worker process did not start"
            time.sleep(0.2)

        outs = [{} for _ in prompts]
        firsts = [threading.Event() for _ in prompts]
        threads = [
            threading.Thread(
                target=_stream, args=(url, chat(p, 60, stream=True), f, o), daemon=True
            )
            for p, f, o in zip(prompts, firsts, outs, strict=True)
        ]
        for t in threads:
            t.start()
        assert all(f.wait(60) for f in firsts), "every stream started"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)

        end = time.time() + 5
        while (ready := httpx.get(url + "/ready", timeout=5)).status_code == 200:
            assert time.time() < end, "/ready still 200 after SIGTERM"
        assert ready.status_code == 503 and ready.json()["status"] == "stopping"
        assert ready.headers["Retry-After"]
        new = httpx.post(url + "/v1/chat/completions", json=chat("w7 w8", 4), timeout=10)
        assert new.status_code == 503 and new.headers["Retry-After"], new.text
        assert new.json()["error"]["type"] == "server_busy"
        assert any(t.is_alive() for t in threads), "the streams were still running"

        for t in threads:
            t.join(60)
        for out in outs:
            assert out["status"] == 200 and out["done"] and out["finish"] == "length", out
        for out, ref in zip(outs, alone, strict=False):
            assert out["text"] == ref["choices"][0]["message"]["content"], "same text as alone"

        rc = proc.wait(drain + 15)
        assert time.monotonic() - t0 < drain, "exited once the streams were done"
        assert rc in (0, -signal.SIGTERM)
        end = time.time() + 10
        while _alive(worker["pid"]) and time.time() < end:
            time.sleep(0.1)
        assert not _alive(worker["pid"]), "the drafter worker process was closed"
        assert sorted(os.listdir(tmp)) == [], "no temporary folder left"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not reaped yet) is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


# ----- the engine loop -----------------------------------------------------------------------
def _post_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        out.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _fail_next_step(batch, times: int = 1) -> None:
    """The scheduler's next ``times`` steps raise outside its own guard (as a bug would)."""
    left = [times]

    def boom() -> None:
        left[0] -= 1
        if left[0] <= 0:
            del batch.step
        raise RuntimeError("injected failure")

    batch.step = boom


def _wait_rows(srv, within: float = 30) -> None:
    end = time.time() + within
    while not srv.worker.batch.rows:
        assert time.time() < end, "the request never started"
        time.sleep(0.01)


def test_a_failed_engine_loop_answers_503_at_once_then_serves_again():
    srv = tiny_server(request_timeout=60.0)
    try:
        ref = httpx.post(srv.url + "/v1/chat/completions", json=chat("w9 w8", 24), timeout=60)
        out: dict = {}
        with slowed(srv, 0.02):
            t = _post_in_thread(srv.url, chat("w9 w8", 400), out)
            _wait_rows(srv)
            _fail_next_step(srv.worker.batch)
            t.join(30)
        assert out["status"] == 503 and out["seconds"] < 20, out
        ready = httpx.get(srv.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "restarting"
        end = time.time() + 15
        while httpx.get(srv.url + "/ready", timeout=5).status_code != 200:
            assert time.time() < end, "the engine loop did not come back"
            time.sleep(0.1)
        again = httpx.post(srv.url + "/v1/chat/completions", json=chat("w9 w8", 24), timeout=60)
        assert again.status_code == 200
        assert (
            again.json()["choices"][0]["message"]["content"]
            == (ref.json()["choices"][0]["message"]["content"])
        )
        assert not srv.worker.batch.rows and srv.worker.batch.kv.reserved == 0
    finally:
        srv.stop()


def test_a_failure_that_keeps_coming_back_fails_the_service_and_asks_to_exit():
    srv = tiny_server(request_timeout=60.0)
    fatal: list[str] = []
    srv.worker.on_fatal = fatal.append
    srv.worker.restarts.backoff_s = srv.worker.restarts.max_backoff_s = 0.05
    try:
        out: dict = {}
        with slowed(srv, 0.02):
            t = _post_in_thread(srv.url, chat("w9 w8", 400), out)
            _wait_rows(srv)
            _fail_next_step(srv.worker.batch, times=100)
            t.join(30)
        assert out["status"] == 503
        end = time.time() + 15
        while not fatal:
            assert time.time() < end, "the worker never gave up"
            time.sleep(0.05)
        ready = httpx.get(srv.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "engine" in ready.json()["error"]
        refused = httpx.post(srv.url + "/v1/chat/completions", json=chat("w1", 4), timeout=10)
        assert refused.status_code == 503
    finally:
        srv.stop()


# ----- pickles at the sockets ----------------------------------------------------------------
def test_the_stats_socket_reads_json_only_and_refuses_a_pickle(tmp_path):
    run = Path(private.make())
    marker = tmp_path / "marker"
    server = StatsServer(str(run / "stats.sock"), lambda q: {"asked": list(q)})
    try:
        evil = pickle.dumps(Marker(marker))
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(run / "stats.sock"))
            s.sendall(struct.pack("!I", len(evil)) + evil)  # multiprocessing's framing
            (n,) = struct.unpack("!I", s.recv(4))
            reply = json.loads(s.recv(n))
            assert "bad question" in reply["error"]
            assert s.recv(1) == b"", "the connection is closed after a bad frame"
        assert not marker.exists()
        client = StatsClient(str(run / "stats.sock"))
        assert client.ask("totals") == {"asked": ["totals"]}, "the server still answers"
        client.close()
    finally:
        server.close()
        private.remove(str(run))
    assert not run.exists()


def test_the_stats_socket_refuses_a_folder_others_can_enter_and_bounds_every_call(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(private.NotPrivateError, match="chmod 700"):
        StatsServer(str(open_dir / "stats.sock"), lambda q: None)
    run = Path(private.make())
    server = StatsServer(str(run / "stats.sock"), lambda q: time.sleep(3) or "late")
    try:
        client = StatsClient(str(run / "stats.sock"), timeout=0.3)
        t0 = time.monotonic()
        assert client.ask("totals") is None
        assert time.monotonic() - t0 < 1.5, "a slow runner costs the caller its timeout only"
        client.close()
    finally:
        server.close()
        private.remove(str(run))


def test_the_worker_reader_refuses_a_pickle_and_marks_the_worker_dead(tmp_path):
    marker = tmp_path / "marker"
    ours, theirs = socket.socketpair()
    mine, peer = Connection(ours.detach()), Connection(theirs.detach())
    client = WorkerClient(lambda m: send(mine, m), lambda: recv(mine))
    try:
        send(peer, Ready({"kind": "process"}))
        assert client.wait_ready(5)
        send(peer, Beat())
        peer.send(Marker(marker))  # Connection.send pickles
        end = time.time() + 5
        while not client.dead:
            assert time.time() < end
            time.sleep(0.01)
        assert "unreadable" in client.why
        assert not marker.exists()
    finally:
        mine.close()
        peer.close()


def test_the_worker_process_refuses_a_pickled_start(tmp_path):
    marker = tmp_path / "marker"
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "d3d.worker.child", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    conn = Connection(ours.detach())
    try:
        conn.send(Marker(marker))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "unreadable message" in err
        assert not marker.exists()
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
