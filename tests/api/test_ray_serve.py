"""Ray Serve: the deployment's options and devices (pure, fast), and two CPU replicas on a real
local Ray cluster behind Ray's own HTTP proxy (slow).

The cluster is the one the deploy guide describes, on one machine: ``ray start --head`` (a
subprocess, its own temp dir and ports, so it never meets another cluster on the host), then
``serve start`` and ``serve run app.ray_serve:build_app replicas=2 cpus=1`` exactly as an operator
types them. Each replica loads the embedded SmolLM2-135M and its drafter. Requests go through
the proxy over a real socket; the ``X-D3D-Replica`` header, a driver's handle calls and Serve's
status show that both replicas serve. The cluster goes down with ``ray start``'s own SIGTERM
path (what ``ray stop`` sends); a plain ``ray stop`` is not used because it stops every Ray
process on the host, other people's clusters included. No process of the cluster may survive.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

serve = pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from app.ray_serve import (  # noqa: E402  (after the importorskip)
    RayOptions,
    ReplicaPlacement,
    deployment_options,
    replica_placement,
)
from d3d.config import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
APP = "d3d"
DOCUMENT = (
    "Notes from the facilities meeting. The loading dock closes at six. "
    "The access code for the north vault is 4417. Visitors sign in at the front desk."
)
CHAT = {
    "model": "default",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 8,
}


# -- options and devices (no cluster) -----------------------------------------------------------


def test_default_is_cpu_replicas_that_autoscale():
    opts = deployment_options(RayOptions.parse({}, environ={}))
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert opts["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 32,
    }
    assert opts["max_ongoing_requests"] == 64 + 128


def test_gpu_pairs_from_the_environment_and_settings_reach_the_replicas():
    env = {"D3D_RAY_GPUS": "2", "D3D_RAY_CPUS": "8", "D3D_RAY_REPLICAS": "3", "D3D_MAX_BATCH": "8"}
    parsed = RayOptions.parse({"D3D_TARGET": "Qwen/Qwen3-8B"}, environ=env)
    assert parsed.env == {"D3D_MAX_BATCH": "8", "D3D_TARGET": "Qwen/Qwen3-8B"}
    opts = deployment_options(parsed)
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    actor = opts["ray_actor_options"]
    assert (actor["num_gpus"], actor["num_cpus"]) == (2.0, 8.0)
    assert actor["runtime_env"] == {"env_vars": parsed.env}
    assert opts["max_ongoing_requests"] == 8 + 128


def test_serve_run_args_win_over_the_environment():
    parsed = RayOptions.parse({"gpus": "1", "max_replicas": "8"}, environ={"D3D_RAY_GPUS": "2"})
    assert (parsed.gpus, parsed.max_replicas, parsed.replicas) == (1.0, 8, None)


@pytest.mark.parametrize(
    "args, field",
    [
        ({"gpus": "two"}, "gpus"),
        ({"replicas": "0"}, "replicas"),
        ({"min_replicas": "3", "max_replicas": "2"}, "max_replicas"),
        ({"cpus": "0"}, "cpus"),
        ({"num_gpus": "2"}, "num_gpus"),
        ({"D3D_RAY_GPUS": "2"}, "D3D_RAY_GPUS"),
        ({"D3D_MAX_BATCH": "0"}, "max_batch"),
    ],
)
def test_bad_options_name_the_field(args, field):
    with pytest.raises(ConfigError, match=field):
        deployment_options(RayOptions.parse(args, environ={}))


def test_replica_devices_follow_ray_grant():
    assert replica_placement([], 1.0) == ReplicaPlacement("cpu", "cpu", 1)
    assert replica_placement([], 3.0) == ReplicaPlacement("cpu", "cpu", 3)
    assert replica_placement([], 0.5) == ReplicaPlacement("cpu", "cpu", 1)
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it gave: they are cuda:0 and cuda:1 in there.
    assert replica_placement([6, 7], 4.0, "6,7") == ReplicaPlacement("cuda:0", "cuda:1", 4)
    assert replica_placement(["3"], 1.0, "3") == ReplicaPlacement("cuda:0", "cuda:0", 1)
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: every GPU visible, the ids are the devices.
    assert replica_placement([2, 5], 1.0, None) == ReplicaPlacement("cuda:2", "cuda:5", 1)


# -- a real local cluster ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    address: str  # the GCS, what `--address` takes
    http: str  # Serve's HTTP proxy
    env: dict
    temp_dir: Path

    def cli(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [str(BIN / args[0]), *args[1:]],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:] + self.logs()
        return out

    def logs(self, lines: int = 30) -> str:
        """The tail of every replica's log (pytest shows it when an assertion fails)."""
        tails = []
        for path in sorted(self.temp_dir.glob("session_latest/logs/serve/replica_*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"\n--- {path.name}\n" + "\n".join(text))
        return "".join(tails)


def stop_tree(head: subprocess.Popen, temp_dir: Path) -> list[str]:
    """SIGTERM ``ray start --block`` (it stops what it started, as ``ray stop`` does), then
    kill anything of this cluster still alive; returns what had to be killed."""
    procs = {}
    with_temp = str(temp_dir)
    with contextlib.suppress(psutil.NoSuchProcess):
        procs = {p.pid: p for p in psutil.Process(head.pid).children(recursive=True)}
    for p in psutil.process_iter(["cmdline"]):
        if with_temp in " ".join(p.info["cmdline"] or []):
            procs.setdefault(p.pid, p)
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait(10)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=20)
    left = []
    for p in alive:
        try:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.fixture(scope="module")
def cluster():
    from d3d.model.load import embedded_default_dir

    embedded_default_dir()  # convert once here, not in two replicas at the same time
    # A short path: Ray's unix sockets live under it (at most 107 bytes).
    temp_dir = Path(tempfile.mkdtemp(prefix="d3d-ray-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        # The replicas import this checkout, not whatever copy is installed.
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # nothing to drain: stop at once
    )
    gcs = free_port()
    log = open(temp_dir / "ray-start.log", "w")  # noqa: SIM115 (closed below)
    head = subprocess.Popen(
        [
            *(str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats"),
            *("--node-ip-address=127.0.0.1", f"--port={gcs}", f"--temp-dir={temp_dir}"),
            *("--num-cpus=2", "--num-gpus=0", "--include-dashboard=false"),
            # Every port that has a fixed default gets a free one: other clusters may run here.
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--object-store-memory=200000000",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    c = Cluster(f"127.0.0.1:{gcs}", "", env, temp_dir)
    try:
        deadline = time.time() + 180
        while not (temp_dir / "ray_current_cluster").exists():
            assert head.poll() is None, (temp_dir / "ray-start.log").read_text()[-3000:]
            assert time.time() < deadline, "the Ray head did not start in 180 s"
            time.sleep(0.5)
        # The proxy's port is picked once the head's processes hold theirs (they take free
        # ports too: one picked before them was taken by one of them in a suite run).
        http = free_port()
        c.http = f"http://127.0.0.1:{http}"
        c.cli(
            *("serve", "start", f"--address={c.address}"),
            *("--http-host=127.0.0.1", f"--http-port={http}"),
            timeout=180,
        )
        yield c
    finally:
        left = stop_tree(head, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes outlived the cluster: {left}"


DRIVER = """
import json, sys
import ray
from ray import serve

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
status = serve.status().applications[sys.argv[2]]
handle = serve.get_app_handle(sys.argv[2])
places = {}
for _ in range(12):
    p = handle.placement.remote().result(timeout_s=60)
    places[p.pop("replica")] = p
    if len(places) == 2:
        break
chat = handle.chat.remote(json.loads(sys.argv[3])).result(timeout_s=300)
print(json.dumps({
    "status": status.status,
    "replicas": {n: d.replica_states for n, d in status.deployments.items()},
    "placements": places,
    "chat": chat,
}))
ray.shutdown()
"""


@pytest.mark.slow
def test_two_cpu_replicas_serve_through_ray_http_proxy(cluster):
    # Returns once both replicas have loaded and warmed up their models.
    out = cluster.cli(
        *("serve", "run", f"--address={cluster.address}", "--non-blocking", f"--name={APP}"),
        *("app.ray_serve:build_app", "replicas=2", "cpus=1", "D3D_MAX_BATCH=2"),
        timeout=480,
    )
    # `serve run` exits 0 even when the deployment failed; it says so in its output.
    said = out.stdout + out.stderr
    assert "unexpected error" not in said, said[-3000:] + cluster.logs()
    url = cluster.http
    assert httpx.get(url + "/-/healthz", timeout=30).status_code == 200  # the proxy's own
    seen: dict[str, dict] = {}
    for _ in range(40):
        r = httpx.get(url + "/ready", timeout=30)
        assert r.status_code == 200, r.text + cluster.logs()
        seen[r.headers["x-d3d-replica"]] = r.json()
        if len(seen) == 2:
            break
    assert len(seen) == 2, f"one replica answered every /ready: {list(seen)}"
    for info in seen.values():
        assert (info["target"], info["target_device"], info["drafter_device"]) == (
            "default",
            "cpu",
            "cpu",
        )

    # The same greedy request, two at a time: the proxy sends the second to the idle replica,
    # and both replicas give the same answer.
    answers: dict[str, str] = {}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(4):
            for r in pool.map(
                lambda _: httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=300), [0, 1]
            ):
                assert r.status_code == 200, r.text + cluster.logs()
                answers[r.headers["x-d3d-replica"]] = r.json()["choices"][0]["message"]["content"]
            if len(answers) == 2:
                break
    assert len(answers) == 2 and len(set(answers.values())) == 1, answers

    qa = {
        "document": DOCUMENT,
        "question": "What is the access code for the north vault?",
        "keep_ratio": 1.0,
        "max_new_tokens": 24,
    }
    r = httpx.post(url + "/qa", json=qa, timeout=300)
    assert r.status_code == 200, r.text + cluster.logs()
    assert "4417" in r.json()["answer"]

    # A driver's view: Serve's status, and the handle path into each replica.
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, cluster.address, APP, json.dumps(CHAT)],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    view = json.loads(out.stdout.strip().splitlines()[-1])
    assert view["status"] == "RUNNING" and view["replicas"] == {"d3d": {"RUNNING": 2}}, view
    assert set(view["placements"]) == set(seen), view
    for place in view["placements"].values():
        # One CPU each from Ray: torch runs one thread, both models on the CPU.
        assert place == {"target_device": "cpu", "drafter_device": "cpu", "threads": 1}
    assert view["chat"]["status"] == 200
    assert view["chat"]["body"]["choices"][0]["message"]["content"] in answers.values()
