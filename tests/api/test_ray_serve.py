"""The Ray Serve deployment in Serve's local testing mode (in-process, CPU): the replica loads
the models, answers /ready, and serves a chat completion equal to the live server's."""

from __future__ import annotations

import os

import httpx
import pytest

pytestmark = pytest.mark.slow
serve = pytest.importorskip("ray.serve")


def test_deployment_options_ask_for_a_gpu_pair_and_autoscale():
    from app.ray_serve import deployment_options
    from app.settings import ServeSettings

    opts = deployment_options(ServeSettings(max_batch=32, max_queue=64))
    assert opts["ray_actor_options"]["num_gpus"] == 2.0
    assert opts["autoscaling_config"]["target_ongoing_requests"] == 16
    assert opts["max_ongoing_requests"] == 96


def test_local_testing_mode_serves_the_same_app(live):
    from app.ray_serve import app

    handle = serve.run(app, name="d3d-test", _local_testing_mode=True)
    ready = handle.ready.remote().result(timeout_s=600)
    assert ready["status"] == 200 and ready["body"]["status"] == "ready", ready
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
    }
    out = handle.chat.remote(body).result(timeout_s=600)
    assert out["status"] == 200
    direct = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert out["body"]["choices"][0]["message"] == direct["choices"][0]["message"]
    assert os.environ.get("D3D_RAY_GPUS") is None  # the test ran with the deployment's defaults
