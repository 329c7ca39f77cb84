"""Scale-out with Ray Serve: replicas of the service that run where Ray placed them.

Each replica is one ``d3d serve`` process's worth of service: it builds the FastAPI app with
:func:`app.main.create_app` (its own engine worker, queue and metrics) and Serve's HTTP proxy on
every node routes requests to the replicas.

**Devices come from what Ray gave the replica**, never from the host's defaults:

- ``gpus=2``: Ray reserves two GPUs and sets ``CUDA_VISIBLE_DEVICES`` to them, so the target runs
  on ``cuda:0`` and the drafter on ``cuda:1`` *of what the replica sees*, whichever of the node's
  GPUs they are. One GPU (or a fraction of one): both models on it.
- ``gpus=0`` (the default): the replica reserves ``cpus`` CPUs, both models run on ``cpu`` with
  torch threads sized to that grant, and the drafter is a thread beside the target (Ray does not
  pin cores, so a drafter process pinned to "its" core could land on another replica's).

A replica counts as started only once its models are loaded and warmed up, so the proxy never
routes to a replica that would answer "still loading", ``serve run`` returns when every replica
can answer, and a model that fails to load fails its replica with the reason. Every response
carries ``X-D3D-Replica`` (the Serve replica id). Serve autoscales on ongoing requests per
replica: the target is half a full batch, so a new replica starts before queues build up.

    serve run app.ray_serve:app                                # options from D3D_RAY_* below
    serve run app.ray_serve:build_app gpus=2 replicas=4 D3D_MAX_BATCH=32

| ``serve run`` arg | variable | default | |
|---|---|---|---|
| ``replicas`` | ``D3D_RAY_REPLICAS`` | unset | a fixed number of replicas (unset: autoscale) |
| ``min_replicas`` / ``max_replicas`` | ``D3D_RAY_MIN_REPLICAS`` / ``..._MAX_...`` | 1 / 4 | autoscaling bounds |
| ``gpus`` | ``D3D_RAY_GPUS`` | 0 | GPUs per replica (2: target and drafter apart) |
| ``cpus`` | ``D3D_RAY_CPUS`` | 1 | CPUs per replica (torch threads on a CPU replica) |

Service and model settings are the ``D3D_*`` variables of ``d3d serve``: those in the environment
of ``serve run`` and those given as its args (``D3D_MAX_BATCH=4``) are set in every replica's
environment, on whichever node it runs; the replica sets the devices and threads itself. Other
deployments can call a replica through its handle (:meth:`D3DService.chat`,
:meth:`D3DService.ready`, :meth:`D3DService.placement`), which go through the same app in-process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import httpx
import ray
from ray import serve

from app.main import create_app
from app.settings import ServeSettings
from d3d.config import ConfigError, ModelConfig

log = logging.getLogger("ray.serve")  # Serve writes this one to the replica's log file

# Option name (a `serve run` arg) -> its environment variable and type.
OPTIONS = {
    "replicas": ("D3D_RAY_REPLICAS", int),
    "min_replicas": ("D3D_RAY_MIN_REPLICAS", int),
    "max_replicas": ("D3D_RAY_MAX_REPLICAS", int),
    "gpus": ("D3D_RAY_GPUS", float),
    "cpus": ("D3D_RAY_CPUS", float),
}


@dataclass(frozen=True)
class RayOptions:
    """What each replica reserves, how many there are, and the settings they are given."""

    replicas: int | None = None  # a fixed count; None: autoscale between min and max
    min_replicas: int = 1
    max_replicas: int = 4
    gpus: float = 0.0  # per replica
    cpus: float = 1.0  # per replica
    env: dict[str, str] = field(default_factory=dict)  # D3D_* variables set in every replica

    def __post_init__(self) -> None:
        checks = [
            (self.replicas is None or self.replicas >= 1, "replicas", "must be >= 1"),
            (self.min_replicas >= 1, "min_replicas", "must be >= 1"),
            (self.max_replicas >= self.min_replicas, "max_replicas", "must be >= min_replicas"),
            (self.gpus >= 0, "gpus", "must be >= 0"),
            (self.cpus >= 0, "cpus", "must be >= 0"),
            (self.gpus > 0 or self.cpus > 0, "cpus", "must be > 0 for a replica without GPUs"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ConfigError(f"{name}: {msg}, got {getattr(self, name)!r}")

    @classmethod
    def parse(
        cls, args: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
    ) -> RayOptions:
        """From ``serve run`` args over ``D3D_RAY_*`` variables; ``D3D_*`` variables and args
        become the replicas' environment."""
        args = dict(args or {})
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, (var, cast) in OPTIONS.items():
            source, raw = (name, args.pop(name)) if name in args else (var, environ.get(var))
            if raw in (None, ""):
                continue
            try:
                values[name] = cast(raw)
            except ValueError:
                raise ConfigError(f"{source}: cannot read {raw!r} as {cast.__name__}") from None
        unknown = [k for k in args if not k.startswith("D3D_") or k.startswith("D3D_RAY_")]
        if unknown:
            raise ConfigError(
                f"{unknown[0]}: not an option (use {', '.join(OPTIONS)} or D3D_* settings)"
            )
        env = {
            k: v
            for k, v in environ.items()
            if k.startswith("D3D_") and not k.startswith("D3D_RAY_")
        }
        env.update({k: str(v) for k, v in args.items()})
        return cls(env=env, **values)  # type: ignore[arg-type]


def deployment_options(opts: RayOptions) -> dict:
    """Serve deployment options for ``opts`` (checks the replicas' service settings once)."""
    settings = ServeSettings.from_env(model=ModelConfig(), environ=opts.env)
    actor: dict = {"num_cpus": opts.cpus, "num_gpus": opts.gpus}
    if opts.env:
        actor["runtime_env"] = {"env_vars": dict(opts.env)}
    out: dict = {
        "ray_actor_options": actor,
        "max_ongoing_requests": settings.max_batch + settings.max_queue,
        "health_check_period_s": 10,
    }
    if opts.replicas is not None:
        out["num_replicas"] = opts.replicas
    else:
        out["autoscaling_config"] = {
            "min_replicas": opts.min_replicas,
            "max_replicas": opts.max_replicas,
            "target_ongoing_requests": max(1, settings.max_batch // 2),
        }
    return out


@dataclass(frozen=True)
class ReplicaPlacement:
    target_device: str
    drafter_device: str
    threads: int


def replica_placement(gpu_ids: list, cpus: float, visible: str | None = None) -> ReplicaPlacement:
    """The devices of a replica that Ray gave ``gpu_ids`` and ``cpus`` CPUs. ``visible`` is
    its ``CUDA_VISIBLE_DEVICES``: Ray sets it to ``gpu_ids``, so they are ``cuda:0``, ``cuda:1``
    ... in the replica (with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` they keep their ids).
    """
    threads = max(1, int(cpus))  # a fractional grant still runs one thread
    if not gpu_ids:
        return ReplicaPlacement("cpu", "cpu", threads)
    seen = [v.strip() for v in visible.split(",")] if visible else []
    local = [seen.index(str(g)) if str(g) in seen else int(g) for g in gpu_ids]
    target = f"cuda:{local[0]}"
    return ReplicaPlacement(target, f"cuda:{local[1]}" if len(local) > 1 else target, threads)


class ReplicaHeader:
    """ASGI middleware: every response says which replica answered (``X-D3D-Replica``)."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (b"x-d3d-replica", replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_tagged)


# Module level on purpose: Ray pickles a class defined at the top of an importable module by
# reference, so each replica imports this module and builds its own app (threads, queues).
@serve.deployment(name="d3d")
@serve.ingress()
class D3DService:
    """One replica: the service's FastAPI app and its engine worker (see the module docstring)."""

    def __init__(self) -> None:
        resources = ray.get_runtime_context().get_assigned_resources()
        self.where = replica_placement(
            ray.get_gpu_ids(), resources.get("CPU", 0.0), os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        self.replica = serve.get_replica_context().replica_tag
        model = ModelConfig.from_env(**asdict(self.where))
        self.settings = ServeSettings.from_env(model=model)
        log.info("replica %s: %s, Ray gave %s", self.replica, self.where, resources)

    async def __serve_build_asgi_app__(self):
        """Serve calls this after ``__init__``: the app, once its models are loaded and warm."""
        app = create_app(self.settings)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        worker = app.state.worker
        worker.start()  # the ASGI lifespan starts it too, later (a no-op then)
        while worker.state == "loading":
            await asyncio.sleep(0.2)
        if worker.state == "failed":
            raise RuntimeError(f"replica {self.replica}: {worker.error}")
        return app

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        # ``self.app`` is the app this replica serves: the handle path and HTTP share its one
        # engine worker.
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

    async def placement(self) -> dict:
        """This replica's id, devices and torch threads, as taken from Ray's grant."""
        return {"replica": self.replica, **asdict(self.where)}

    def check_health(self) -> None:
        worker = self.app.state.worker
        if worker.state == "failed":
            raise RuntimeError(worker.error)


def build_app(args: dict[str, str] | None = None) -> serve.Application:
    """The application for ``serve run app.ray_serve:build_app key=value ...``."""
    return D3DService.options(**deployment_options(RayOptions.parse(args))).bind()


app = build_app()
