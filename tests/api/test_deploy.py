"""The Dockerfile's two images read as text (entry point, health check, user, GPU settings), the
cpu image's entry point run directly, and hadolint over the Dockerfile when it is installed. The
images themselves are built and run in a Docker engine by test_docker_image.py."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def stage(name: str) -> str:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    parts = re.split(r"^FROM ", text, flags=re.M)
    return next(p for p in parts if re.match(rf"\S+ AS {name}$", p, flags=re.M))


def stage_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", text, flags=re.M):
        env.update(dict(tok.split("=", 1) for tok in shlex.split(line) if "=" in tok))
    return env


def entrypoint(text: str) -> list[str]:
    import json

    return json.loads(re.search(r"^ENTRYPOINT (\[.+\])$", text, flags=re.M).group(1))


def test_both_stages_serve_with_a_ready_healthcheck_and_no_root():
    for name in ("cpu", "gpu"):
        text = stage(name)
        assert entrypoint(text) == ["d3d", "serve"]
        assert "/ready" in re.search(r"HEALTHCHECK .+", text).group(0)
        user = re.findall(r"^USER (\S+)$", text, flags=re.M)
        assert user and user[-1] not in ("root", "0")
    gpu = stage_env(stage("gpu"))
    assert (gpu["D3D_TARGET_DEVICE"], gpu["D3D_DRAFTER_DEVICE"]) == ("cuda:0", "cuda:1")
    assert "VOLUME" in stage("gpu") and "huggingface" in stage("gpu")


@pytest.mark.skipif(
    shutil.which("hadolint") is None and not (Path(sys.prefix) / "bin/hadolint").exists(),
    reason="hadolint not installed",
)
def test_hadolint_is_clean():
    exe = shutil.which("hadolint") or str(Path(sys.prefix) / "bin/hadolint")
    r = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_cpu_image_entrypoint_serves(tmp_path):
    """Run the cpu stage's ENTRYPOINT with its ENV (host and port adjusted to this machine)."""
    text = stage("cpu")
    env = {**os.environ, **stage_env(text)}
    port = free_port()
    env.update(D3D_HOST="127.0.0.1", D3D_PORT=str(port), D3D_THREADS="2")
    env["D3D_CACHE_DIR"] = os.environ.get("D3D_CACHE_DIR", str(Path.home() / ".cache" / "d3d"))
    env.pop("HF_HOME", None)
    cmd = entrypoint(text)
    exe = shutil.which(cmd[0]) or str(Path(sys.prefix) / "bin" / cmd[0])
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([exe, *cmd[1:]], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        ready = None
        while time.time() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(url + "/ready", timeout=5)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert ready is not None and ready.status_code == 200, (tmp_path / "serve.log").read_text()
        assert ready.json()["target_device"] == "cpu"
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        logs = (tmp_path / "serve.log").read_text()
        assert "target default on cpu" in logs and "warm-up done" in logs
        assert "failed" not in logs, logs  # the warm-up built the document reader, for one
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
