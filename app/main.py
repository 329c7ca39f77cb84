"""The FastAPI application: routes, error handlers, middleware, and the engine worker's lifetime.

``create_app(settings)`` builds an app whose lifespan starts the engine worker (which loads the
models in the background, so ``/health`` answers at once and ``/ready`` turns 200 when the models
are loaded and warmed up) and stops it on shutdown, after the drain of :mod:`app.lifecycle`
(SIGTERM: new requests 503, running ones finish). ``uvicorn --factory app.main:create_app``
builds one from ``D3D_*`` variables.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles

from app import errors
from app.engines import make_engine
from app.engines.own import load_engine
from app.lifecycle import Admission, Lifecycle
from app.metrics import Metrics
from app.middleware import RequestContext
from app.routes import openai, ops, qa
from app.schemas import QARequest
from app.settings import ServeSettings
from d3d.model.load import DEFAULT_SPECS, EMBEDDED_NAME


def model_name(settings: ServeSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    target = settings.model.target
    if target.lower() in DEFAULT_SPECS:
        return EMBEDDED_NAME
    return Path(target).name if target.startswith((".", "/", "~")) else target


def create_app(settings: ServeSettings | None = None, engine_factory=load_engine) -> FastAPI:
    settings = settings or ServeSettings.from_env()
    metrics = Metrics()
    worker = make_engine(settings, metrics, engine_factory)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(
        title="D3D service",
        version="0.1.0",
        summary="Document QA with prompt compression and lossless speculative decoding",
        lifespan=lifespan,
    )
    app.state.settings, app.state.metrics, app.state.worker = settings, metrics, worker
    app.state.model_name = model_name(settings)
    app.state.started = int(time.time())
    app.state.lifecycle = Lifecycle(settings.drain_timeout)
    errors.install(app)
    for router in (ops.router, qa.router, openai.router):
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=ops.STATIC), name="static")
    app.add_middleware(Admission, lifecycle=app.state.lifecycle)  # inside RequestContext
    app.add_middleware(
        RequestContext,
        metrics=metrics,
        max_body_bytes=settings.max_body_bytes,
        api_key=settings.api_key,
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the /qa body models (that route parses JSON or multipart itself)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    qa_schema = QARequest.model_json_schema(ref_template="#/components/schemas/{model}")
    comps.update(qa_schema.pop("$defs", {}))
    comps["QARequest"] = qa_schema
    app.openapi_schema = schema
    return schema
