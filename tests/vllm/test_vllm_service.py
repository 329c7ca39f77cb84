"""``d3d serve --engine vllm`` over real sockets (vLLM's CPU build, the embedded model and its
drafter), started as a user starts it, in a process of its own: the same routes as the own
engine; answers in every mode equal ``ar``; ``/ready`` reports the drafter worker; ``/metrics``
has vLLM's ``vllm:spec_decode_*`` counters beside the project's branch statistics; ``/qa``
answers with kept spans from a kept prompt equal to the own engine's, read by the drafter
worker; steps without drafts cost the engine core no round trip for drafts (``/metrics``); the
API process holds no model (at most 1 GiB resident once ready) and the drafter is loaded once, in
that worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.documents import Documents
from d3d.config import ModelConfig
from d3d.engine import Engine
from eval.serve_load import wait_ready
from tests.api.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
DOCUMENT = (
    "The harbour town keeps its old lighthouse. " * 6
    + "Marta keeps her blue bicycle in a shed behind the bakery in Prague. "
    + "Ferries leave every hour for the islands. " * 8
)
QUESTION = "Where does Marta keep her bicycle?"


API_RSS_LIMIT = 1 << 30  # bytes: the API process holds no model (issue 44)


class Served:
    def __init__(self, url: str, proc: subprocess.Popen):
        self.url, self.proc = url, proc


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_serve") / "serve.log"
    cmd = [sys.executable, "-m", "d3d", "serve", "--engine", "vllm", "--vllm-eager",
           "--max-batch", "8", "--port", str(port)]  # fmt: skip
    # As a user starts it: none of the D3D_* or VLLM_* settings earlier tests left in this
    # process's environment (vLLM's engine set-up writes them for its own children).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("D3D_", "VLLM_"))}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: ample here, and allocated whole at start
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, timeout=600, proc=proc, log=log)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {Path(log).read_text()[-4000:]}") from None
        yield Served(url, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def rss(pid: int) -> int:
    """Resident bytes of a process (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").iterdir():
            kids = (task / "children").read_text().split()
            out += [int(k) for k in kids]
            todo += [int(k) for k in kids]
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_api_process_holds_no_model_and_the_drafter_is_loaded_once(served):
    """Once ready: the API process at most 1 GiB resident (no target weights, no drafter), and
    one drafter worker process in the tree, which ``/ready`` names and which reads documents."""
    body = httpx.get(served.url + "/ready", timeout=10).json()
    assert body["reading"] == "drafter worker"
    used = rss(served.proc.pid)
    assert used <= API_RSS_LIMIT, f"API process resident {used / 2**30:.2f} GiB"
    workers = [p for p in descendants(served.proc.pid) if "d3d.worker.child" in cmdline(p)]
    assert workers == [body["drafter_worker"]["pid"]], [cmdline(p) for p in workers]


def samples(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def chat(url: str, mode: str) -> dict:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "List the days of the week."}],
        "max_tokens": 32,
        "speculative": {"mode": mode},
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_ready_reports_the_engine_and_the_drafter_worker(served):
    r = httpx.get(served.url + "/ready", timeout=10).json()
    assert r["status"] == "ready" and r["engine"] == "vllm"
    w = r["drafter_worker"]
    assert w["state"] == "up" and isinstance(w["pid"], int) and w["restarts"] == 0


def test_every_mode_answers_as_ar_and_vllm_counts_the_drafts(served):
    before = samples(served.url)
    ref = chat(served.url, "ar")["choices"][0]["message"]["content"]
    for mode in ("sync", "async", "auto"):
        out = chat(served.url, mode)
        assert out["choices"][0]["message"]["content"] == ref, mode
        assert out["speculative"]["mode"] == mode
    after = samples(served.url)
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    assert after[accepted] > before.get(accepted, 0.0)
    assert after["d3d_spec_decode_num_drafts_total"] > before["d3d_spec_decode_num_drafts_total"]
    assert after["d3d_drafter_worker_up"] == 1.0


def proposer_steps(url: str, done, within: float = 15.0) -> dict[str, float]:
    """The proposer's step counts on ``/metrics`` once ``done(counts)`` holds (they are polled
    from vLLM's runner every second)."""
    end = time.time() + within
    while True:
        got = {k: v for k, v in samples(url).items() if k.startswith("d3d_vllm_")}
        if done(got) or time.time() > end:
            return got
        time.sleep(0.2)


def settled(url: str, within: float = 15.0) -> dict[str, float]:
    """The proposer's step counts once two polls a second apart agree."""
    last = proposer_steps(url, lambda c: "d3d_vllm_plain_steps_total" in c)
    end = time.time() + within
    while time.time() < end:
        time.sleep(1.2)
        now = proposer_steps(url, lambda c: True)
        if now == last:
            break
        last = now
    return last


def test_steps_without_drafts_skip_the_engine_cores_round_trip(served):
    """As the product runs vLLM (its engine core and model runner in processes of their own):
    an ``ar`` request's steps take vLLM's plain path and the engine core fetches no drafts after
    them; a ``sync`` request's steps fetch drafts."""
    before = settled(served.url)  # the warm-up's last steps counted
    n = chat(served.url, "ar")["usage"]["completion_tokens"]
    plain = "d3d_vllm_plain_steps_total"
    mid = proposer_steps(served.url, lambda c: c[plain] - before[plain] >= n)
    assert mid[plain] - before[plain] >= n, "each step of an ar request"
    for key in ("d3d_vllm_speculative_steps_total", "d3d_vllm_draft_fetches_total"):
        assert mid[key] == before[key], key
    chat(served.url, "sync")
    fetches = "d3d_vllm_draft_fetches_total"
    after = proposer_steps(served.url, lambda c: c[fetches] > mid[fetches])
    assert after[fetches] > mid[fetches], "drafts still reach the scheduler"
    assert after["d3d_vllm_speculative_steps_total"] > mid["d3d_vllm_speculative_steps_total"]


def test_qa_keeps_the_own_engines_prompt(served):
    body = {
        "document": DOCUMENT,
        "question": QUESTION,
        "keep_ratio": 0.2,
        "max_new_tokens": 16,
        "return_prompt": True,
    }
    r = httpx.post(served.url + "/qa", json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["compression"]["kept_spans"], "kept spans of the document"
    engine = Engine.from_config(ModelConfig())
    own = Documents.for_engine(engine).prepare(DOCUMENT, QUESTION, 0.2, "auto", 8000)
    assert got["prompt"] == engine.tokenizer.decode(own.prompt_ids, skip_special_tokens=False)
    assert got["compression"]["kept_spans"] == own.info["kept_spans"]


def test_the_drafter_killed_under_eight_clients_costs_no_answer(served):
    """``kill -9`` of the pid ``/ready`` reports while eight streaming async requests run: every
    answer as alone, the server ready throughout, the worker back with a new pid, reading
    documents again."""
    prompts = [f"Count from {i} to {i + 12}, one number a line." for i in range(8)]

    def body(p: str, stream: bool) -> dict:
        return {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": p}],
            "max_tokens": 24,
            "stream": stream,
            "speculative": {"mode": "async"},
        }

    alone = [
        httpx.post(served.url + "/v1/chat/completions", json=body(p, False), timeout=300).json()[
            "choices"
        ][0]["message"]["content"]
        for p in prompts
    ]
    first = httpx.get(served.url + "/ready", timeout=10).json()["drafter_worker"]

    async def one(client: httpx.AsyncClient, p: str, kill: bool) -> str:
        text = ""
        async with client.stream(
            "POST", served.url + "/v1/chat/completions", json=body(p, True)
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if kill and text:
                        os.kill(first["pid"], signal.SIGKILL)
                        kill = False
        return text

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p, i == 0) for i, p in enumerate(prompts)))

    assert asyncio.run(all_of_them()) == alone
    assert httpx.get(served.url + "/ready", timeout=10).status_code == 200
    end = time.time() + 60
    while time.time() < end:
        w = httpx.get(served.url + "/ready", timeout=10).json()["drafter_worker"]
        if w["state"] == "up" and w["restarts"] >= first["restarts"] + 1:
            break
        time.sleep(0.5)
    assert w["state"] == "up" and w["pid"] != first["pid"], w
    # The replacement reads documents too (the service's reading client reconnects).
    qa = {"document": DOCUMENT, "question": QUESTION, "keep_ratio": 0.2, "max_new_tokens": 8}
    r = httpx.post(served.url + "/qa", json=qa, timeout=300)
    assert r.status_code == 200, r.text
