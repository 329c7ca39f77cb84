"""``d3d compress`` and ``d3d qa``: thin commands over :mod:`compression`.

``d3d compress --document FILE --question TEXT`` prints the kept text (or JSON with ``--json``);
``d3d qa`` compresses and then answers with the engine (speculative decoding by default). Bad
input (missing or empty file, keep ratio outside (0, 1], unknown scorer) is a ``ValueError`` or
``FileNotFoundError``, which ``d3d`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from compression.compressor import SCORERS, CompressionConfig, attention_preset
from compression.qa import QA_TEMPLATE, answer_document, compress_document
from d3d.cli import add_decode_args, add_model_args, decode_config, model_config


def add_compression_args(p: argparse.ArgumentParser, keep: bool = True) -> None:
    g = p.add_argument_group("compression")
    if keep:
        g.add_argument("--keep", type=float, default=0.1, help="keep ratio in (0, 1]")
        g.add_argument("--scorer", default="drafter-attention", help=f"one of {', '.join(SCORERS)}")
    g.add_argument("--chunk-size", type=int, default=32, help="tokens per chunk")
    g.add_argument("--granularity", default="chunk", choices=["chunk", "sentence"])
    g.add_argument("--random-seed", type=int, default=0, help="seed of the random scorer")
    g.add_argument("--score-layers", type=int, default=None, help="layers that read the prompt")
    g.add_argument(
        "--score-reader", default=None, choices=["drafter", "target"], help="whose layers read"
    )
    g.add_argument("--score-heads", default=None, help="layer:head list (e.g. 7:7,6:1), or 'all'")
    g.add_argument("--lookahead", default=None, choices=["on", "off"], help="append a draft block")
    g.add_argument("--quantize", default=None, choices=["on", "off"], help="int8 reader layers")


def _heads(text: str) -> tuple[tuple[int, int], ...] | None:
    if text == "all":
        return None
    try:
        return tuple(
            (int(a), int(b)) for a, b in (pair.split(":") for pair in text.split(",") if pair)
        )
    except ValueError:
        raise ValueError(f"--score-heads must look like 7:7,6:1 or 'all', got {text!r}") from None


def compression_config(
    args: argparse.Namespace, target_spec: str, with_keep: bool = True
) -> CompressionConfig:
    """The compression flags as a config (``with_keep=False``: scorer and keep come elsewhere)."""
    att = attention_preset(target_spec)
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
    return CompressionConfig(
        scorer=args.scorer if with_keep else "drafter-attention",
        keep_ratio=args.keep if with_keep else 1.0,
        chunk_size=args.chunk_size,
        granularity=args.granularity,
        seed=args.random_seed,
        attention=att,
    )


def read_document(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"document not found: {p}")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"document is empty: {p}")
    return text


def _engine(args: argparse.Namespace, with_drafter: bool):
    from d3d.engine import Engine

    return Engine.from_config(model_config(args), with_drafter=with_drafter)


def cmd_compress(args: argparse.Namespace) -> int:
    document = read_document(args.document)
    mcfg = model_config(args)
    ccfg = compression_config(args, mcfg.target)
    engine = _engine(args, with_drafter=ccfg.scorer in ("drafter-attention", "drafter-ppl"))
    comp, _ = compress_document(engine, document, args.question, ccfg, args.template)
    text = engine.tokenizer.decode(comp.parts.context)
    if args.json:
        print(json.dumps({"kept_text": text, "compression": comp.to_dict()}))
    else:
        sys.stdout.write(text + "\n")
    return 0


def cmd_qa(args: argparse.Namespace) -> int:
    document = read_document(args.document)
    mcfg = model_config(args)
    ccfg = compression_config(args, mcfg.target)
    dcfg = decode_config(args)
    engine = _engine(args, with_drafter=True)
    result = answer_document(engine, document, args.question, ccfg, dcfg, args.template)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.answer)
        c = result.compression
        print(
            f"[{c.scorer} kept {c.kept_tokens}/{c.total_tokens} tokens in {c.seconds:.2f} s; "
            f"total {result.timings['total_s']:.2f} s]",
            file=sys.stderr,
        )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--document", required=True, help="text file to read")
    p.add_argument("--question", required=True, help="the question about the document")
    p.add_argument("--template", default=QA_TEMPLATE, help="prompt with {context} and {input}")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(p)
    add_compression_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compress", help="keep the part of a document that matters for a question")
    _common(p)
    p.set_defaults(func=cmd_compress)
    q = sub.add_parser("qa", help="compress a document, then answer a question about it")
    _common(q)
    add_decode_args(q, default_max=64)
    q.set_defaults(func=cmd_qa)
