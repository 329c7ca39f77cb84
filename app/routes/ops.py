"""Operations: liveness, readiness, Prometheus metrics, and the page at ``/``."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.auth import authorized
from app.documents import DEFAULT_KEEP_RATIO

router = APIRouter(tags=["ops"])
STATIC = Path(__file__).resolve().parent.parent / "static"


@router.get("/health")
async def health():
    """Liveness: the process answers (models may still be loading)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    """Readiness: models loaded and a tiny generation done (503 until then). With an API key
    set, a caller without it sees the state only (model paths, the drafter worker's pid and a
    load error's text stay in the log)."""
    worker = request.app.state.worker
    if not authorized(request.headers.get("authorization", ""), request.app.state.settings.api_key):
        code, retry = (200, {}) if worker.ready else (503, {"Retry-After": "5"})
        return JSONResponse({"status": worker.state}, status_code=code, headers=retry)
    if worker.ready:
        return {
            "status": "ready",
            "model": request.app.state.model_name,
            **worker.model_info,
            "drafter_worker": worker.drafter_worker(),
        }
    body = {"status": worker.state, "error": worker.error or None}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus text format."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
async def page():
    """The page, its keep slider at the service's default keep ratio."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    return HTMLResponse(html.replace("{{keep}}", f"{DEFAULT_KEEP_RATIO:g}"))
