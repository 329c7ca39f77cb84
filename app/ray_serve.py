"""Scale-out with Ray Serve: one replica per GPU pair, the same FastAPI app as ingress.

Each replica is one ``d3d serve`` process's worth of service: it builds the FastAPI app with
:func:`app.main.create_app` (its own engine worker, queue and metrics) and holds two GPUs (Ray
sets ``CUDA_VISIBLE_DEVICES``, so the default ``cuda:0`` target / ``cuda:1`` drafter placement
holds inside every replica). Serve autoscales on ongoing requests per replica: the target is
half a full batch, so a new replica starts before queues build up.

    serve run app.ray_serve:app                  # HTTP on :8000, routes as in `d3d serve`
    D3D_RAY_GPUS=0 serve run app.ray_serve:app   # CPU only

Settings come from the same ``D3D_*`` variables as ``d3d serve``; ``D3D_RAY_GPUS`` (2),
``D3D_RAY_MIN_REPLICAS`` (1) and ``D3D_RAY_MAX_REPLICAS`` (4) shape the deployment. Other
deployments can call a replica through its handle with :meth:`D3DService.chat` and
:meth:`D3DService.ready`, which go through the same app in-process.
"""

from __future__ import annotations

import asyncio
import os

import httpx
from ray import serve

from app.main import create_app
from app.settings import ServeSettings


def deployment_options(settings: ServeSettings) -> dict:
    return {
        "ray_actor_options": {"num_gpus": float(os.environ.get("D3D_RAY_GPUS", "2"))},
        "max_ongoing_requests": settings.max_batch + settings.max_queue,
        "autoscaling_config": {
            "min_replicas": int(os.environ.get("D3D_RAY_MIN_REPLICAS", "1")),
            "max_replicas": int(os.environ.get("D3D_RAY_MAX_REPLICAS", "4")),
            "target_ongoing_requests": max(1, settings.max_batch // 2),
        },
        "health_check_period_s": 10,
    }


# Module level on purpose: Ray pickles a class defined at the top of an importable module by
# reference, so the FastAPI app (threads, queues) is rebuilt by import inside each replica.
SETTINGS = ServeSettings.from_env()
fastapi_app = create_app(SETTINGS)


@serve.deployment(name="d3d", **deployment_options(SETTINGS))
@serve.ingress(fastapi_app)
class D3DService:
    """One replica: the service's FastAPI app and its engine worker (see the module docstring)."""

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        # ``self.app`` is the app this replica serves (Serve's own copy of ``fastapi_app``): the
        # handle path and HTTP share its one engine worker. Starting it is a no-op once the ASGI
        # lifespan has.
        self.app.state.worker.start()
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://d3d") as client:
            r = await client.request(method, path, json=body, timeout=None)
        return {"status": r.status_code, "body": r.json()}

    async def ready(self, timeout: float = 600.0) -> dict:
        """Wait until the replica's models are loaded and warmed up; its /ready body."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        out = await self._call("GET", "/ready")
        while out["status"] != 200 and out["body"].get("status") != "failed":
            if loop.time() > deadline:
                break
            await asyncio.sleep(0.5)
            out = await self._call("GET", "/ready")
        return out

    async def chat(self, body: dict) -> dict:
        """``POST /v1/chat/completions`` through this replica's app (status and JSON body)."""
        return await self._call("POST", "/v1/chat/completions", body)

    def check_health(self) -> None:
        worker = self.app.state.worker
        if worker.state == "failed":
            raise RuntimeError(worker.error)


app = D3DService.bind()
