"""``d3d serve``: run the service with uvicorn (registered through the ``d3d.commands`` group).

Flags map onto :class:`~app.settings.ServeSettings`; each has a ``D3D_*`` environment twin, and
flags win. Startup logs say what was loaded, on which device, and the warm-up figures.
"""

from __future__ import annotations

import argparse
import logging

from d3d.cli import add_model_args, model_config

# Input limits and uvicorn's connection limits: (setting, type, what), defaults ServeSettings';
# docs/service.md's Limits table names them all.
LIMIT_FLAGS = (
    ("max_body_bytes", int, "largest request body in bytes"),
    ("max_new_tokens", int, "largest max_tokens a request may ask"),
    ("max_n", int, "most choices (n) a request may ask"),
    ("max_logprobs", int, "most log-probability alternatives per token"),
    ("max_stop_sequences", int, "most stop strings per request"),
    ("max_stop_chars", int, "longest stop string in characters"),
    ("max_stop_token_ids", int, "most stop_token_ids per request"),
    ("max_pdf_pages", int, "most pages of an uploaded PDF"),
    ("max_pdf_chars", int, "most characters of a PDF's text"),
    ("pdf_timeout", float, "seconds to read a PDF's text"),
    ("limit_concurrency", int, "open connections before new ones get 503"),
    ("timeout_keep_alive", float, "seconds an idle keep-alive connection stays open"),
)


def cmd_serve(args: argparse.Namespace) -> int:
    from app.lifecycle import serve
    from app.main import create_app
    from app.settings import ServeSettings

    settings = ServeSettings.from_env(
        model=model_config(args),
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        max_document_tokens=args.max_document_tokens,
        api_key=args.api_key,
        api_key_file=args.api_key_file,
        **{name: getattr(args, name) for name, *_ in LIMIT_FLAGS},
        request_timeout=args.request_timeout,
        served_model_name=args.served_model_name,
        doc_cache_dir=args.doc_cache_dir,
        copy=False if args.no_copy else None,
        prefill_share=args.prefill_share,
        prefill_floor=args.prefill_floor,
        engine=args.engine,
        vllm_eager=True if args.vllm_eager else None,
        drain_timeout=args.drain_timeout,
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("app").setLevel(logging.INFO)
    log = logging.getLogger("app")
    m = settings.model
    log.info(
        "d3d serve (%s engine): target %s on %s, drafter %s on %s; http://%s:%d (max batch %d, "
        "max queue %d, API key %s)",
        settings.engine,
        m.target,
        m.target_device,
        m.drafter,
        m.resolved_drafter_device,
        settings.host,
        settings.port,
        settings.max_batch,
        settings.max_queue,
        "required" if settings.api_key else "off",
    )
    # SIGTERM drains (new requests 503, running ones get --drain-timeout), then stops.
    return serve(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        limit_concurrency=settings.limit_concurrency,
        timeout_keep_alive=settings.timeout_keep_alive,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the HTTP service (/qa, OpenAI-compatible routes, page)")
    p.add_argument("--host", default=None, help="bind address (D3D_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (D3D_PORT, default 8000)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests before 503 (128)")
    p.add_argument("--max-batch", type=int, default=None, help="requests decoded together (64)")
    p.add_argument(
        "--max-document-tokens", type=int, default=None, help="largest /qa document (8000)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on /v1/* and /qa (D3D_API_KEY; a flag shows in "
        "`ps`: prefer --api-key-file or the variable)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (D3D_API_KEY_FILE)",
    )
    from app.settings import ServeSettings

    for name, cast, what in LIMIT_FLAGS:
        flag, var = "--" + name.replace("_", "-"), "D3D_" + name.upper()
        default = ServeSettings.__dataclass_fields__[name].default
        p.add_argument(flag, type=cast, default=None, help=f"{what} ({var}, default {default})")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds (300)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send")
    p.add_argument(
        "--doc-cache-dir",
        default=None,
        help="keep each document's reading on disk too (D3D_DOC_CACHE_DIR; default memory only)",
    )
    p.add_argument(
        "--no-copy",
        action="store_true",
        help="auto requests never draft by copying their own text (D3D_COPY=0)",
    )
    p.add_argument(
        "--prefill-share",
        type=float,
        default=None,
        help="while requests decode, chunks of other prompts read in the same forward may make "
        "the step at most this much longer again (D3D_PREFILL_SHARE, default 2.0: decoding rows "
        "at most about 3x slower while long prompts are read, in exchange for reading them "
        "faster)",
    )
    p.add_argument(
        "--prefill-floor",
        type=float,
        default=None,
        metavar="SECONDS",
        help="... or this long, where that is more than the share (D3D_PREFILL_FLOOR, default "
        "0.5: with few rows decoding, a share of their short step reads documents slowly)",
    )
    p.add_argument(
        "--engine",
        choices=("own", "vllm"),
        default=None,
        help="decode with the project's engine (own, default) or vLLM's with the D3D drafter as "
        "its speculative proposer (vllm: needs vLLM installed, `make setup` does; D3D_ENGINE)",
    )
    p.add_argument(
        "--vllm-eager",
        action="store_true",
        help="vLLM without compilation: starts in seconds, decodes slower (D3D_VLLM_EAGER=1)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="after SIGTERM, new requests get 503 and running ones this long to finish before "
        "the engine stops (D3D_DRAIN_TIMEOUT, default 60)",
    )
    add_model_args(p)
    p.set_defaults(func=cmd_serve)
