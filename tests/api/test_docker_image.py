"""The CPU image in a real Docker engine: `make docker-cpu` builds `d3d:cpu`, and a container of it
must become ready and healthy (the image's own HEALTHCHECK command, polled every 2 s here),
answer `/qa` from the document, serve the page, and serve as a user other than root.

Slow: a first build takes minutes (base image, Python, torch, the dependencies, the embedded
model converted); later builds reuse every layer whose inputs did not change. Skipped where no
Docker engine answers (`.ci/run` installs and starts one).
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "d3d:cpu"
DOCUMENT = (
    "Notes from the facilities meeting. The loading dock closes at six. "
    "The access code for the north vault is 4417. Visitors sign in at the front desk."
)

pytestmark = pytest.mark.slow


def docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed (.ci/run installs Debian's docker.io)")
    info = docker("info", "--format", "{{.ServerVersion}}")
    if info.returncode != 0:
        pytest.skip(f"no Docker engine answers: {info.stderr.strip()[-300:]}")
    build = subprocess.run(
        ["make", "docker-cpu"], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    return IMAGE


@pytest.fixture()
def container(image):
    """A running container of the image on a free loopback port: (id, base URL)."""
    name = f"d3d-test-{uuid.uuid4().hex[:8]}"
    run = docker(
        *("run", "-d", "--name", name, "-p", "127.0.0.1::8000"),
        *("--health-interval", "2s", "--health-start-period", "120s", image),
    )
    assert run.returncode == 0, run.stderr
    try:
        port = docker("port", name, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
        yield name, f"http://127.0.0.1:{port}"
    finally:
        logs = docker("logs", "--tail", "60", name)  # pytest shows them when the test fails
        print(logs.stdout + logs.stderr)
        docker("rm", "-f", "-v", name)


def state(name: str, field: str) -> str:
    return docker("inspect", "-f", "{{" + field + "}}", name).stdout.strip()


def wait_for(what: str, check, name: str, seconds: float):
    deadline = time.time() + seconds
    while time.time() < deadline:
        assert state(name, ".State.Running") == "true", f"the container stopped before {what}"
        result = check()
        if result:
            return result
        time.sleep(1)
    raise AssertionError(f"no {what} within {seconds:.0f} s")


def test_cpu_image_serves_qa_healthy_and_not_as_root(container):
    name, url = container

    def ready():
        try:
            r = httpx.get(url + "/ready", timeout=5)
        except httpx.TransportError:
            return None
        return r if r.status_code == 200 else None

    info = wait_for("/ready", ready, name, 180).json()
    assert (info["target"], info["target_device"]) == ("default", "cpu")
    wait_for("healthy status", lambda: state(name, ".State.Health.Status") == "healthy", name, 60)

    body = {
        "document": DOCUMENT,
        "question": "What is the access code for the north vault?",
        "keep_ratio": 1.0,
        "max_new_tokens": 24,
    }
    r = httpx.post(url + "/qa", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert "4417" in r.json()["answer"]
    page = httpx.get(url + "/", timeout=10)  # app/static ships in the installed package
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]

    assert state(name, ".Config.User") == "10001"
    status = docker("exec", name, "cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    cmdline = docker("exec", name, "cat", "/proc/1/cmdline").stdout.split("\0")
    assert "serve" in cmdline and set(uids) == {"10001"}, (cmdline, uids)
