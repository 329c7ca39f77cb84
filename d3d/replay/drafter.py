"""The replay instrument in the engine: where a drafter would be, and what it does per request.

:class:`ReplayDrafter` is what ``--drafter replay:...`` loads (:func:`build_replay`). It keeps
the :class:`~d3d.replay.book.ReplayBook` and takes part in each request through
:meth:`ReplayDrafter.for_request`, which the engine calls with the proposer of the request's
mode:

- ``ar``: the proposer also records what the target commits (the recording a replay needs);
- ``sync`` / ``async``: the request must be greedy and recorded, else a clear error now; its
  statistics are labelled with the spec and "(measurement instrument)";
- anything else (``auto``): an error; the instrument serves those two modes.

``sync`` drafts in the engine's process through :meth:`ReplayDrafter.session` (the standard
:class:`~d3d.decoding.proposers.SyncProposer` around it); ``async`` goes through the drafter
worker as any drafter does, the worker running a :class:`~d3d.replay.server.ReplayServer`
(:meth:`ReplayDrafter.server`), and :class:`ReplayLink` sends each request's recording with
its ``Open``. Output stays exactly the target's: every proposal is verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Protocol

import torch
from torch import nn

from d3d.config import DEFAULT_BLOCK_SIZE, SamplingConfig
from d3d.decoding.proposers import ArProposer, Proposer
from d3d.decoding.stats import DecodeStats
from d3d.decoding.verify import Acceptance
from d3d.model.drafter import D3DDrafter, Draft, DrafterError
from d3d.model.load import LoadedModel
from d3d.replay.book import ReplayBook
from d3d.replay.schedule import Replay
from d3d.replay.server import ReplayOpen, ReplayServer
from d3d.replay.shape import fold, is_random, random_shape, shape_vocab
from d3d.replay.spec import ReplaySpec, parse_replay
from d3d.worker.proposer import BatchedLink, WorkerLink
from d3d.worker.protocol import Open
from d3d.worker.server import ServerConfig

MODES = ("sync", "async")


class ReplayRequest(Protocol):
    """What the replay reads of a request (the engine's :class:`~d3d.engine.request.GenRequest`)."""

    mode: str
    sampling: SamplingConfig
    prompt_ids: Sequence[int]
    draft_prompt_ids: Sequence[int] | None
    stats: DecodeStats | None


class ReplayDrafter:
    """The replay instrument (see the module docstring). ``shape``: a drafter whose forwards
    run beside the replay for their time (:mod:`d3d.replay.shape`)."""

    def __init__(
        self,
        spec: ReplaySpec,
        vocab_size: int,
        device: str | torch.device = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        shape: D3DDrafter | None = None,
    ):
        spec.check_block(block_size)
        self.spec = spec
        self.vocab_size = vocab_size
        self.device = torch.device(device) if shape is None else shape.device
        self.block_size = block_size if shape is None else shape.block_size
        self.shape = shape
        self.book = ReplayBook()

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def lm(self) -> nn.Module:
        """The shape's LM (what the loader packs); an empty module without a shape."""
        return self.shape.lm if self.shape is not None else nn.Module()

    def __repr__(self) -> str:
        return f"ReplayDrafter({self.label})"

    # ----- per request ------------------------------------------------------------------
    def for_request(self, req: ReplayRequest, proposer: Proposer) -> Proposer:
        """The proposer ``req`` runs with (see the module docstring); raises DrafterError with
        the fix for a request the replay cannot serve."""
        if req.mode == "ar":
            return Recorder(self.book)
        if req.mode not in MODES:
            raise DrafterError(
                f"{self.label} serves modes {' and '.join(MODES)} (ar runs record what it "
                f"replays), not {req.mode!r}"
            )
        if not req.sampling.greedy:
            raise DrafterError(
                f"{self.label} replays the target's greedy output: a sampled request "
                "(temperature > 0) cannot be replayed"
            )
        prompt = req.draft_prompt_ids if req.draft_prompt_ids is not None else req.prompt_ids
        if self.book.get(prompt, req.sampling) is None:
            raise self.missing()
        if req.stats is not None:  # the scheduler gives every request its stats first
            req.stats.drafter = self.label
        return proposer

    def missing(self) -> DrafterError:
        return DrafterError(
            f"{self.label} has no recording of this prompt: it replays the target's own greedy "
            "output, which an ar run of the same prompt through this engine records; run it "
            "in mode ar first (d3d generate does), or call engine.record(prompts, max_new_tokens)"
        )

    # ----- sync: drafting in this process -----------------------------------------------
    def session(self, sampling: SamplingConfig, generator: torch.Generator | None) -> ReplaySession:
        if not sampling.greedy:
            raise DrafterError(f"{self.label} replays greedy output only (temperature 0)")
        return ReplaySession(self, sampling)

    # ----- async: the worker ------------------------------------------------------------
    def link(self, link: WorkerLink) -> ReplayLink:
        """The engine's batched link to the worker ``link``, sending each request's recording
        with its ``Open``."""
        return ReplayLink(link, self)

    def server(self, cfg: ServerConfig | None = None) -> ReplayServer:
        """What the drafter worker runs (:func:`d3d.worker.workers.server_for`)."""
        return ReplayServer(self, cfg)


class ReplaySession:
    """One ``sync`` request: the recorded block for each round, after the shape's real block
    forward where there is a shape (its output unused)."""

    def __init__(self, drafter: ReplayDrafter, sampling: SamplingConfig):
        self.drafter, self.sampling = drafter, sampling
        self.replay: Replay | None = None
        shape = drafter.shape
        self.shape = None if shape is None else shape.session(SamplingConfig())

    def draft(self, token_ids: Sequence[int]) -> Draft:
        d = self.drafter
        if self.shape is not None:
            self.shape.draft(fold(token_ids, shape_vocab(d.shape)))
        if self.replay is None:
            found = d.book.find(token_ids, self.sampling)
            if found is None:
                raise d.missing()
            self.replay = Replay(*found, d.spec, d.block_size - 1, d.vocab_size)
        planned = self.replay.after(token_ids)
        self.replay.settle(planned)
        return Draft(torch.tensor(planned.tokens, dtype=torch.long), None)


class Recorder(ArProposer):
    """``ar`` that records what the target commits into the book (plain greedy requests)."""

    def __init__(self, book: ReplayBook):
        self.book = book
        self.key: tuple[list[int], SamplingConfig] | None = None
        self.out: list[int] = []

    def start(self, prompt_ids, sampling, generator, draft_prompt_ids=None, first_len=None) -> None:
        prompt = draft_prompt_ids if draft_prompt_ids is not None else prompt_ids
        self.key = (list(prompt), sampling) if sampling.greedy else None
        self.out = []

    def observe(self, acc: Acceptance, verify_s: float, next_len: int | None = None) -> None:
        self.out += acc.tokens

    def close(self) -> None:
        if self.key is not None:
            self.book.record(*self.key, self.out)


class ReplayLink(BatchedLink):
    """The engine's link to the worker for a replay: a step's commits go out together, and
    each ``Open`` carries the request's recording (:class:`~d3d.replay.server.ReplayOpen`),
    since the worker may be another process."""

    def __init__(self, link: WorkerLink, drafter: ReplayDrafter):
        super().__init__(link)
        self.drafter = drafter

    def send(self, msg: object) -> None:
        if isinstance(msg, Open) and not isinstance(msg, ReplayOpen):
            output = self.drafter.book.get(msg.prompt_ids, msg.sampling)
            if output is None:
                raise self.drafter.missing()
            msg = ReplayOpen(**{f.name: getattr(msg, f.name) for f in fields(msg)}, output=output)
        super().send(msg)


def build_replay(
    spec: str,
    target: LoadedModel,
    device: str | torch.device | None = None,
    shape: D3DDrafter | None = None,
) -> ReplayDrafter:
    """The replay drafter of ``spec`` (``replay:TAU[:HIT][:SHAPE]``) for ``target`` on
    ``device`` (default: the target's). A ``shape=CONFIG[@LAYERS]`` shape is built here; a
    shape that is a drafter spec comes built as ``shape`` (:func:`d3d.engine.build_drafter`
    builds it the engine's way)."""
    rs = parse_replay(spec)
    dev = device or target.device
    if rs.shape and shape is None:
        if not is_random(rs.shape):
            raise DrafterError(
                f"replay shape {rs.shape!r} is a drafter spec: build the replay with "
                "d3d.engine.build_drafter, which builds its shape"
            )
        shape = random_shape(rs.shape, dev, target.model.dtype)
    return ReplayDrafter(rs, target.vocab_size, dev, shape=shape)
