"""``d3d compress`` and ``d3d qa``: thin commands over :mod:`compression`.

``d3d compress --document FILE --question TEXT`` prints the kept text (or JSON with ``--json``);
``d3d qa`` compresses and then answers with the engine (``--json`` also reports ``prompt``, the
exact text the target read); ``--question`` may be given several times: the questions share one
:class:`~compression.qa.DocumentQA`, so the document is read once. Bad input (missing or empty file, keep ratio outside (0, 1], unknown scorer) is a
``ValueError`` or ``FileNotFoundError``, which ``d3d`` prints as one line with exit code 2,
before any model loads. ``--doc-cache-dir`` keeps the reader's pass on disk, so the next
``d3d qa`` about the same document skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from compression.compressor import (
    DEFAULT_SCORER,
    DRAFTER_SCORERS,
    SCORERS,
    CompressionConfig,
)
from compression.doc_cache import DocumentCache
from compression.drafter_scorers import AttentionScoring
from compression.gaps import GAPS
from compression.presets import attention_preset
from compression.qa import QA_TEMPLATE, DocumentQA
from compression.selection import DEFAULT_KEEP_RATIO
from compression.units import GRANULARITIES
from d3d.cli import add_decode_args, add_model_args, decode_config, model_config


def add_compression_args(p: argparse.ArgumentParser, keep: bool = True) -> None:
    g = p.add_argument_group("compression")
    if keep:
        g.add_argument(
            "--keep", type=float, default=DEFAULT_KEEP_RATIO, help="keep ratio in (0, 1]"
        )
        g.add_argument("--scorer", default=DEFAULT_SCORER, help=f"one of {', '.join(SCORERS)}")
    g.add_argument("--chunk-size", type=int, default=32, help="tokens per unit (packed, chunk)")
    g.add_argument("--granularity", default="packed", choices=list(GRANULARITIES))
    g.add_argument("--neighbours", type=int, default=0, help="units kept around a chosen one")
    g.add_argument(
        "--gap",
        default=CompressionConfig.gap,
        choices=list(GAPS),
        help="what marks a cut between kept runs: ' ... ', a newline, or nothing",
    )
    g.add_argument(
        "--head",
        type=float,
        default=CompressionConfig.head,
        help="share of the kept tokens spent on the document's opening (the same for every "
        "question, so a second question reuses the target's work on it)",
    )
    g.add_argument("--random-seed", type=int, default=0, help="seed of the random scorer")
    g.add_argument("--score-layers", type=int, default=None, help="layers that read the prompt")
    g.add_argument(
        "--score-reader", default=None, choices=["drafter", "target"], help="whose layers read"
    )
    g.add_argument("--score-heads", default=None, help="layer:head list (e.g. 7:7,6:1), or 'all'")
    g.add_argument("--lookahead", default=None, choices=["on", "off"], help="append a draft block")
    g.add_argument("--quantize", default=None, choices=["on", "off"], help="int8 reader layers")
    g.add_argument(
        "--question-int8",
        action="store_true",
        help="drafter/hybrid scorers: an int8 copy of the drafter reads (about half the time)",
    )
    g.add_argument("--score-window", type=int, default=None, help="reading window in tokens")
    g.add_argument(
        "--score-workers",
        type=int,
        default=None,
        help="windows read at once (default: the cores torch's threads leave idle; 1 on a GPU)",
    )
    g.add_argument(
        "--fusion", default=None, help="attention-bm25 weights attention,bm25 (e.g. 1,1)"
    )


def _heads(text: str) -> tuple[tuple[int, int], ...] | None:
    if text == "all":
        return None
    try:
        return tuple(
            (int(a), int(b)) for a, b in (pair.split(":") for pair in text.split(",") if pair)
        )
    except ValueError:
        raise ValueError(f"--score-heads must look like 7:7,6:1 or 'all', got {text!r}") from None


def _weights(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--fusion must look like 1,1 (attention,bm25), got {text!r}") from None
    return a, b


def attention_config(args: argparse.Namespace, preset: AttentionScoring) -> AttentionScoring:
    """The preset with the ``--score-*`` flags applied."""
    att = preset
    if args.score_layers is not None:
        att = replace(att, layers=args.score_layers)
    if args.score_reader is not None:
        att = replace(att, reader=args.score_reader)
    if args.score_heads is not None:
        att = replace(att, heads=_heads(args.score_heads))
    if args.lookahead is not None:
        att = replace(att, lookahead=args.lookahead == "on")
    if args.quantize is not None:
        att = replace(att, quantize=args.quantize == "on")
    if args.score_window is not None:
        att = replace(att, window=args.score_window)
    if args.score_workers is not None:
        att = replace(att, workers=args.score_workers)
    return att


def compression_config(
    args: argparse.Namespace, target_spec: str, with_keep: bool = True, drafter=None
) -> CompressionConfig:
    """The compression flags as a config (``with_keep=False``: scorer and keep come elsewhere).

    The attention preset depends on the drafter; called before loading (``drafter=None``) it
    checks the flags, and again after loading it gives the config to use.
    """
    cfg = CompressionConfig(
        scorer=args.scorer if with_keep else DEFAULT_SCORER,
        keep_ratio=args.keep if with_keep else 1.0,
        chunk_size=args.chunk_size,
        granularity=args.granularity,
        neighbours=args.neighbours,
        gap=args.gap,
        head=args.head,
        seed=args.random_seed,
        attention=attention_config(args, attention_preset(target_spec, drafter)),
        question_int8=args.question_int8,
    )
    if args.fusion is not None:
        cfg = replace(cfg, fusion_weights=_weights(args.fusion))
    return cfg


def read_document(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"document not found: {p}")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"document is empty: {p}")
    return text


def document_qa(args: argparse.Namespace, with_drafter: bool = True) -> DocumentQA:
    """Check the flags, load the models, and build the document-QA object."""
    from d3d.engine import Engine

    mcfg = model_config(args)
    ccfg = compression_config(args, mcfg.target)  # fails on bad flags before loading
    engine = Engine.from_config(mcfg, with_drafter=with_drafter)
    if getattr(args, "mode", None) == "auto":
        engine.calibrate()  # a fresh host: auto decides from the first token
    ccfg = compression_config(args, mcfg.target, drafter=engine.drafter)
    cache = DocumentCache(directory=args.doc_cache_dir) if args.doc_cache_dir else None
    return DocumentQA(engine, ccfg, cache, template=args.template, target_spec=mcfg.target)


def _check_questions(args: argparse.Namespace) -> list[str]:
    questions = [q for q in args.question if q is not None]
    if any(not q.strip() for q in questions):
        raise ValueError("a --question is empty")
    return questions


def cmd_compress(args: argparse.Namespace) -> int:
    document = read_document(args.document)
    questions = _check_questions(args)
    needs_drafter = args.scorer in DRAFTER_SCORERS
    qa = document_qa(args, with_drafter=needs_drafter)
    for question in questions:
        comp = qa.compress(qa.parts(document, question))
        text = qa.tokenizer.decode(comp.parts.context)
        if args.json:
            print(
                json.dumps({"question": question, "kept_text": text, "compression": comp.to_dict()})
            )
        else:
            sys.stdout.write(text + "\n")
    return 0


def cmd_qa(args: argparse.Namespace) -> int:
    document = read_document(args.document)
    questions = _check_questions(args)
    dcfg = decode_config(args)
    qa = document_qa(args)
    for question in questions:
        result = qa.answer(
            document, question, dcfg, draft_from_document=args.draft_from == "document"
        )
        if args.json:
            print(json.dumps({**result.to_dict(), "prompt": qa.prompt_text(result)}))
            continue
        print(result.answer)
        c, t = result.compression, result.timings
        print(
            f"[{c.scorer} kept {c.kept_tokens}/{c.total_tokens} tokens; compress "
            f"{t.compress_s:.2f} s{' (document cached)' if result.cached else ''}; "
            f"total {t.total_s:.2f} s]",
            file=sys.stderr,
        )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--document", required=True, help="text file to read")
    p.add_argument(
        "--question", required=True, action="append", help="a question (repeat for several)"
    )
    p.add_argument("--template", default=QA_TEMPLATE, help="prompt with {context} and {input}")
    p.add_argument("--json", action="store_true", help="print one JSON object per question")
    p.add_argument(
        "--doc-cache-dir",
        default=os.environ.get("D3D_DOC_CACHE_DIR") or None,
        help="keep the reader's pass over each document in this folder too, so a later run "
        "skips it (default: $D3D_DOC_CACHE_DIR; unset: memory only)",
    )
    add_model_args(p, remember_costs=True)
    add_compression_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compress", help="keep the part of a document that matters for a question")
    _common(p)
    p.set_defaults(func=cmd_compress)
    q = sub.add_parser("qa", help="compress a document, then answer questions about it")
    _common(q)
    add_decode_args(q, default_max=64)
    q.add_argument(
        "--draft-from",
        default="kept",
        choices=["kept", "document"],
        help="what the drafter reads: the kept prompt, or the full document (lossless either way)",
    )
    q.set_defaults(func=cmd_qa)
