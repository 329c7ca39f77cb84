"""``python -m tests.api.lifecycle_server FOLDER PORT DRAIN``: the service as ``d3d serve``
runs it (:func:`app.lifecycle.serve`: SIGTERM drains, then stops), on the tiny model saved in
``FOLDER`` with its first layer as the drafter in a worker process on the last core, every
engine step slowed by :data:`STEP_S` so that streams are still running when the signal comes."""

from __future__ import annotations

import sys
import time

from app.engines.own import load_engine
from app.lifecycle import serve
from app.main import create_app
from app.settings import ServeSettings
from d3d.config import ModelConfig
from d3d.worker.workers import available_cores

# A 60-token stream lasts at least 3.6 s: time for the SIGTERM checks while it runs (at 0.03 s a
# step the streams once ended first, on a loaded host).
STEP_S = 0.06


def slow_engine(settings: ServeSettings):
    engine = load_engine(settings)
    engine.target.model.register_forward_pre_hook(lambda *_: time.sleep(STEP_S))
    return engine


def main(argv: list[str]) -> int:
    folder, port, drain = argv[0], int(argv[1]), float(argv[2])
    cfg = ModelConfig(
        target=folder, drafter="self:1", drafter_device=f"cpu:{available_cores()[-1]}"
    )
    settings = ServeSettings(
        model=cfg, port=port, served_model_name="tiny", drain_timeout=drain, warmup=False
    )
    return serve(create_app(settings, slow_engine), "127.0.0.1", port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
