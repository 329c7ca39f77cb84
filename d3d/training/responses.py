"""``d3d data``: the target's greedy responses, generated through the engine's scheduler.

Design:

- A :class:`Responder` decodes; this module chooses prompts and writes records. The own
  engine's (:class:`EngineResponder`) sends the prompts through the same
  :class:`~d3d.engine.Scheduler` that ``d3d generate`` and the service decode through, as
  ``ar`` requests (the target alone, greedy). Up to ``batch_size`` requests run at once and a
  new one joins as soon as another finishes (continuous batching): no row waits for the longest
  answer of a static batch, and no compute goes to padding past a row's end. Each row's output
  is plain greedy decoding of the target, whatever shares the batch (up to float summation
  order), so a batch of 16 writes the records one at a time would. ``--engine vllm``
  (:class:`d3d.training.vllm_responses.VllmResponder`) decodes the same greedy responses with vLLM's
  batching, the fast path on a GPU.
- Records are appended as requests finish, one flushed line each; a rerun skips ids already
  written (in the output and in any of its shard files), and a line torn by a killed run is
  dropped first (:func:`d3d.training.data.read_jsonl`).
- Sharding: ``--shard i/n`` (or torchrun's RANK / WORLD_SIZE, one shard per process and GPU)
  takes the prompts whose id hashes to i modulo n and writes ``OUT`` with ``.shard-i-of-n``
  before its suffix; the shards of one run never overlap and together hold every prompt.
- Evaluation items stay out: a prompt from an evaluation source, or one whose text contains an
  evaluation item (:mod:`.contamination`), is refused unless ``allow_eval`` (then written with
  ``eval_set`` set, which training refuses in turn unless asked).
- Soft labels (``topk``): after a response is done, one target forward over prompt + response
  gives the target's top-k log-probabilities at each response position.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from d3d.engine import Engine, GenRequest
from d3d.training.contamination import EvalIndex
from d3d.training.data import EVAL_SOURCES, data_files, is_heldout, read_jsonl
from d3d.training.sources import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataConfig:
    """How to generate: the held-out share, the limits, the batch and the soft labels."""

    heldout_fraction: float = 0.08
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    batch_size: int = 16
    topk: int = 0  # keep the target's top-k log-probs at each response token (soft labels)
    allow_eval: bool = False  # write prompts found in an evaluation set (labelled eval_set)

    def __post_init__(self) -> None:
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction: must be in [0, 1), got {self.heldout_fraction}")
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens < 8:
            raise ValueError(f"max_prompt_tokens: must be >= 8, got {self.max_prompt_tokens}")
        if self.topk < 0:
            raise ValueError(f"topk: must be >= 0, got {self.topk}")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the prompts whose id hashes to ``index`` modulo ``count``."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard: need 0 <= i < n in i/n, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str | None) -> Shard:
        """``"i/n"``; None: torchrun's RANK/WORLD_SIZE when set, else the whole set."""
        if text is None:
            return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError as exc:
            raise ValueError(f"shard: use i/n (e.g. 0/4), got {text!r}") from exc
        return cls(i, n)

    def holds(self, prompt_id: str) -> bool:
        h = int.from_bytes(hashlib.sha256(f"shard/{prompt_id}".encode()).digest()[:8], "big")
        return h % self.count == self.index

    def path(self, out: Path) -> Path:
        if self.count == 1:
            return out
        return out.with_name(f"{out.stem}.shard-{self.index}-of-{self.count}{out.suffix}")


def done_ids(out: Path) -> set[str]:
    """Ids already written to ``out`` or its shard files (torn last lines dropped)."""
    return {r["id"] for p in data_files(out) if p.is_file() for r in read_jsonl(p, repair=True)}


@dataclass
class DataReport:
    """What a run wrote and skipped, and how fast."""

    out: str
    written: int = 0
    response_tokens: int = 0
    seconds: float = 0.0
    skipped_done: int = 0
    skipped_long: int = 0
    refused_eval: list[str] = field(default_factory=list)  # ids of prompts in evaluation sets
    eval_sets_checked: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.response_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "out": self.out,
            "written": self.written,
            "response_tokens": self.response_tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "skipped_done": self.skipped_done,
            "skipped_long": self.skipped_long,
            "refused_eval": len(self.refused_eval),
            "eval_sets_checked": self.eval_sets_checked,
        }


def _eval_set(p: Prompt, index: EvalIndex | None) -> str | None:
    if p.source in EVAL_SOURCES:
        return p.source
    if index is None:
        return None
    texts = [m["content"] for m in p.messages] if p.messages else [p.text]
    return next((s for t in texts if (s := index.match(t)) is not None), None)


@torch.inference_mode()
def top_k(model, prompt_ids: Sequence[int], response: Sequence[int], k: int) -> dict:
    """The target's top-k ids and log-probs (3 decimals) at each response position."""
    ids = torch.tensor([[*prompt_ids, *response]], device=next(model.parameters()).device)
    p = len(prompt_ids)
    logits = model(input_ids=ids[:, :-1]).logits[0, p - 1 :].float()  # [len(response), V]
    top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return {
        "topk_ids": top.indices.tolist(),
        "topk_logprobs": [[round(v, 3) for v in r] for r in top.values.tolist()],
    }


@dataclass(frozen=True)
class Response:
    """Prompt ``index``'s greedy response (``error``: why there is none)."""

    index: int
    tokens: list[int]
    error: BaseException | None = None


class Responder(Protocol):
    """Greedy responses of the target, and its tokenizer (see the module docstring)."""

    @property
    def tokenizer(self): ...

    def respond(
        self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int
    ) -> Iterator[Response]:
        """Each prompt's response as soon as it is done, in any order."""
        ...

    def top_k(self, prompt_ids: Sequence[int], response: Sequence[int], k: int) -> dict:
        """The target's top-k ids and log-probs at each response position (:func:`top_k`)."""
        ...


class EngineResponder:
    """The own engine's scheduler as a :class:`Responder` (continuous batching of ``ar``)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def respond(
        self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int
    ) -> Iterator[Response]:
        sched = self.engine.scheduler()
        sched.max_batch = batch_size  # whatever the engine's scheduler ran before
        todo = deque(enumerate(prompts))
        finished: list[Response] = []
        live = 0
        while todo or live:
            while todo and live < batch_size:  # rows join as others finish
                i, ids = todo.popleft()
                tokens: list[int] = []

                def done(_stats, err, i=i, tokens=tokens) -> None:
                    finished.append(Response(i, tokens, err))

                sched.add(GenRequest(list(ids), max_new_tokens, mode="ar", copy=False,
                                     on_tokens=tokens.extend, on_finish=done))  # fmt: skip
                live += 1
            sched.step()
            live -= len(finished)
            yield from finished
            finished.clear()

    def top_k(self, prompt_ids: Sequence[int], response: Sequence[int], k: int) -> dict:
        return top_k(self.engine.target.model, prompt_ids, response, k)


def _record(source: Responder, p: Prompt, ids: list[int], resp: list[int], cfg: DataConfig) -> dict:
    rec = {
        "id": p.id,
        "source": p.source,
        "split": "heldout" if is_heldout(p.id, cfg.heldout_fraction) else "train",
        "prompt": p.text,
        "prompt_ids": ids,
        "response_ids": resp,
        "text": source.tokenizer.decode(resp, skip_special_tokens=True),
    }
    if p.messages is not None:
        rec["messages"] = [dict(m) for m in p.messages]
    if cfg.topk and resp:
        rec.update(source.top_k(ids, resp, cfg.topk))
    return rec


Todo = tuple[Prompt, list[int], "str | None"]  # a prompt, its ids, the evaluation set it is in


def _todo(tokenizer, prompts, out, cfg, shard, index, report) -> list[Todo]:
    done = done_ids(out)
    todo = []
    for p in prompts:
        if not shard.holds(p.id):
            continue
        if p.id in done:
            report.skipped_done += 1
            continue
        found = _eval_set(p, index)
        if found is not None and not cfg.allow_eval:
            report.refused_eval.append(p.id)
            continue
        ids = p.encode(tokenizer)
        if len(ids) > cfg.max_prompt_tokens:
            log.info("skipping %s: %d prompt tokens", p.id, len(ids))
            report.skipped_long += 1
            continue
        todo.append((p, ids, found))
    if report.refused_eval:
        log.warning("refused %d prompt(s) found in an evaluation set (first: %s)",
                    len(report.refused_eval), report.refused_eval[0])  # fmt: skip
    return todo


def generate_data(
    source: Engine | Responder,
    prompts: Sequence[Prompt],
    out_path: str | Path,
    cfg: DataConfig,
    shard: Shard = Shard(),
    index: EvalIndex | None = None,
    progress: bool = True,
) -> DataReport:
    """Append the target's greedy responses to ``prompts`` (this shard's, not yet written) to
    ``shard.path(out_path)``, decoded by ``source`` (an engine: its scheduler; see the module
    docstring). Each record is flushed as its response is done."""
    responder = EngineResponder(source) if isinstance(source, Engine) else source
    out = shard.path(Path(out_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    report = DataReport(out=str(out), eval_sets_checked=index.sets if index is not None else [])
    todo = _todo(responder.tokenizer, prompts, Path(out_path), cfg, shard, index, report)
    if out.is_file() and out.stat().st_size and not out.read_bytes().endswith(b"\n"):
        with out.open("a") as f:  # a whole last line without its newline: end it first
            f.write("\n")
    t0 = time.perf_counter()
    responses = responder.respond([ids for _, ids, _ in todo], cfg.max_new_tokens, cfg.batch_size)
    with out.open("a", encoding="utf-8") as f, tqdm(total=len(todo), desc="responses",
                                                    disable=not progress) as bar:  # fmt: skip
        for r in responses:
            p, ids, found = todo[r.index]
            if r.error is not None:
                raise RuntimeError(f"generating {p.id} failed: {r.error}") from r.error
            rec = _record(responder, p, ids, r.tokens, cfg)
            if found is not None:
                rec["eval_set"] = found
            f.write(json.dumps(rec) + "\n")
            f.flush()
            report.written += 1
            report.response_tokens += len(r.tokens)
            bar.update(1)
    report.seconds = time.perf_counter() - t0
    return report
