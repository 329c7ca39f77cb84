"""The engine's front object: a loaded target and drafter, and text in / text out.

Used by the CLI, the web app and the evaluation harnesses. It loads models from specs
(:mod:`d3d.engine.loading`; :class:`d3d.config.ModelConfig`), checks at load that the drafter
fits the target (same vocabulary), and owns what outlives a request: the one
:class:`~d3d.engine.scheduler.Scheduler` every request decodes through, the drafter worker
(:mod:`d3d.engine.drafter_host`), the host's measured costs that ``auto`` decides from
(:class:`d3d.decoding.policy.HostCosts`) and the prefix cache. Each request gets a proposer for
its mode: ``ar`` (the target alone), ``sync`` (draft, then verify: in this process, or on the
worker where it drafts every row's block in one forward), ``async`` (blocks prepared by
the worker during verification), ``auto`` (speculation and copy rounds only where they pay;
async when a worker runs, else sync).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from d3d.backends import Backend, choose
from d3d.backends.clock import Clock
from d3d.backends.kv import default_kv_tokens
from d3d.config import DEFAULT_BLOCK_SIZE, CacheBudget, DecodeConfig, ModelConfig, SamplingConfig
from d3d.decoding.lookup import CopyDrafts
from d3d.decoding.policy import HostCosts
from d3d.decoding.proposers import ArProposer, Proposer
from d3d.decoding.stats import DecodeStats
from d3d.engine.calibration import seed
from d3d.engine.cost_memory import costs_path, load_costs, save_costs
from d3d.engine.drafter_host import DrafterHost, launch_process
from d3d.engine.kv_store import PrefixCache
from d3d.engine.loading import (
    build_drafter,
    check_device,
    drafter_backend,
    drafter_layers,
    placement_for,
)
from d3d.engine.request import GenRequest, Row
from d3d.engine.scheduler import PrefillBudget, Scheduler
from d3d.engine.stream import stream
from d3d.model.drafter import D3DDrafter, DrafterError
from d3d.model.load import LoadedModel, encode_prompt, load_target
from d3d.model.memory import prefix_cache_bytes
from d3d.model.specs import Speculation, speculation
from d3d.replay import ReplayDrafter
from d3d.worker.modes import ModeKit, drafts_rows_together
from d3d.worker.proposer import BatchedLink
from d3d.worker.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """A finished request: the text, the generated ids and the decode statistics."""

    text: str
    token_ids: list[int]
    stats: DecodeStats

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids}
        out.update(self.stats.to_dict())
        return out


class Engine:
    """A target (and optionally a drafter) ready to decode (see the module docstring)."""

    def __init__(
        self,
        target: LoadedModel,
        drafter: D3DDrafter | None = None,
        model_cfg: ModelConfig | None = None,
        backend: Backend | None = None,
        off_reason: str = "no drafter loaded",
    ):
        """``backend``: how the target runs (:mod:`d3d.backends`; default: chosen by its
        device); ``off_reason``: why there is no drafter, when there is none."""
        self.target = target
        self.drafter = drafter
        self.speculation = Speculation(
            None if drafter is None else (model_cfg.drafter if model_cfg else "given"),
            "" if drafter is not None else off_reason,
        )
        self.model_cfg = model_cfg
        self.backend = backend or choose("auto", target.device)
        self.host = HostCosts()
        # The target's KV of prompt prefixes requests share, sized from the memory there is.
        budget = model_cfg.cache_budget if model_cfg is not None else CacheBudget()
        self.prefix_cache = PrefixCache(prefix_cache_bytes(target.model, budget))
        self.drafters = DrafterHost(model_cfg, str(target.device), drafter)
        self._batched: BatchedLink | None = None
        self._scheduler: Scheduler | None = None
        self.default_block = DEFAULT_BLOCK_SIZE  # the copy rounds' block without a drafter
        self.clock = Clock([target.device, getattr(drafter, "device", target.device)])
        vocab = getattr(getattr(drafter, "meta", None), "vocab_size", 0)
        if drafter is not None and vocab not in (0, target.vocab_size):
            raise DrafterError(
                f"drafter vocabulary ({vocab}) does not match the target's ({target.vocab_size})"
            )

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, with_drafter: bool = True, start_worker: bool = False
    ) -> Engine:
        """Load the models; ``start_worker`` starts the drafter worker now (a worker process
        then loads its drafter while this process loads the target)."""
        check_device(cfg.target_device)
        if cfg.drafter_device:
            check_device(cfg.drafter_device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        backend = choose(cfg.backend, cfg.target_device, pack=cfg.pack, fuse=cfg.fuse)
        chosen = speculation(cfg.drafter, cfg.target)
        if with_drafter and not chosen.on:
            log.warning("speculation off: %s", chosen.reason)
        with_drafter = with_drafter and chosen.on
        if with_drafter:
            drafter_layers(cfg.drafter, cfg.target)  # a named checkpoint is read before the target
        place = placement_for(cfg)
        early = launch_process(cfg, place) if with_drafter and start_worker else None
        target = load_target(cfg.target, device=cfg.target_device, dtype=cfg.dtype)
        backend.prepare(target.model)  # packing, kernels, graphs: the backend's
        drafter = (
            build_drafter(cfg.drafter, target, cfg.resolved_drafter_device, share_layers=True)
            if with_drafter
            else None
        )
        if drafter is not None:
            drafter_backend(cfg).prepare_drafter(drafter.lm)
        reason = chosen.reason or "not loaded in this process"
        engine = cls(target, drafter, cfg, backend, off_reason=reason)
        if cfg.costs_dir:
            engine.remember_costs(costs_path(cfg, cfg.costs_dir))
        if early is not None:
            engine.drafters.adopt(early)
        elif with_drafter and start_worker:
            engine.worker(wait=False)
        return engine

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def remember_costs(self, path: Path) -> None:
        """Start from the decoding costs stored at ``path`` (if any) and store this engine's
        there when the process ends (:mod:`d3d.engine.cost_memory`)."""
        self.host = load_costs(path) or self.host
        atexit.register(save_costs, self.host, path)

    def calibrate(self) -> dict | None:
        """On a fresh host, time a plain step, a verify and a drafter block and take the
        drafter's shipped acceptance, so ``auto`` decides from the first token
        (:mod:`d3d.engine.calibration`); None when the host already has figures. Waits for the drafter
        worker first: its loading would share the cores with the timing."""
        if self.host.step_s.value is not None:
            return None
        if self.drafter is not None:
            self.worker()
        figures = seed(
            self.host,
            self.target.model,
            self.drafter,
            self.block_size,
            self._read_cost(),
            self.cpu_budget,
            self.clock,
            self.backend,
        )
        log.info("calibrated decoding costs: %s", figures)
        return figures

    # ----- the drafter worker (d3d.engine.drafter_host) -------------------------------------
    def worker(self, wait: bool = True, timeout: float = 600.0) -> Supervisor | None:
        """The drafter worker's supervisor, started on first use (it replaces a worker that dies
        or hangs: :mod:`d3d.worker.supervisor`)."""
        return self.drafters.worker(wait, timeout)

    @property
    def worker_restarts(self) -> int:
        return self.drafters.restarts

    def worker_status(self) -> dict | None:
        """The drafter worker's state, pid and restarts (None: no drafter worker)."""
        return self.drafters.status()

    @property
    def manage_cpu(self) -> bool:
        return self.drafters.manage_cpu

    @manage_cpu.setter
    def manage_cpu(self, value: bool) -> None:
        self.drafters.manage_cpu = value

    def cpu_budget(self, speculating: bool) -> None:
        """Fewer cores for the target while a drafter process drafts, all of them otherwise."""
        self.drafters.cpu_budget(speculating)

    def spare_thread(self) -> None:
        """Keep the calling thread (a document reader) off the target's cores."""
        self.drafters.spare_thread()

    def reading(self):
        """A context for work on the drafter's device beside decoding (reading a document):
        ``auto`` starts no speculative run meanwhile."""
        return self.drafters.reading()

    def close(self) -> None:
        """Stop the drafter worker (and give the target its cores back)."""
        self.drafters.close()

    # ----- decoding ---------------------------------------------------------------------
    def proposer(self, mode: str, budget: int | None = None, copy: bool = True) -> Proposer:
        """The proposer of ``mode`` for one request (``budget``: its max new tokens; ``copy``:
        auto may verify copies of the request's own text, :mod:`d3d.decoding.lookup`). ``auto``
        without a drafter takes plain steps and copy rounds (:mod:`d3d.worker.modes`); ``sync``
        and ``async`` without one raise :class:`DrafterError` saying why speculation is off."""
        why = self.speculation.refusal(mode)
        if why is not None:
            raise DrafterError(why)
        on_worker = self.drafter is not None and drafts_rows_together(self.drafter)
        linked = mode in ("async", "auto") or (mode == "sync" and on_worker)
        kit = ModeKit(
            self.host,
            self.target.vocab_size,
            max_len=self.block_size - 1,
            link=self._link() if self.drafter is not None and linked else None,
            drafter=self.drafter,
            read_cost=self._read_cost(),
            copies=self._copies,
            busy=self.drafters.busy,
            clock=self.clock,
            sync_on_worker=on_worker,
        )
        return kit.proposer(mode, budget, copy)

    @property
    def block_size(self) -> int:
        return self.drafter.block_size if self.drafter is not None else self.default_block

    def _link(self) -> BatchedLink | None:
        """The drafter worker behind a link that sends a step's commits together (None when the
        drafter is not a :class:`D3DDrafter`, e.g. a test double: it drafts synchronously)."""
        if not isinstance(self.drafter, D3DDrafter | ReplayDrafter):
            return None
        worker = self.worker()
        if worker is None:
            return None
        if self._batched is None or self._batched.link is not worker:
            if isinstance(self.drafter, ReplayDrafter):  # recordings travel with requests
                self._batched = self.drafter.link(worker)
            else:
                self._batched = BatchedLink(worker)
        return self._batched

    def _copies(self) -> CopyDrafts:
        return CopyDrafts(
            self.host.copy, max_len=self.block_size - 1, vocab_size=self.target.vocab_size
        )

    def _read_cost(self) -> float:
        """The drafter's cost of reading a token relative to the target's prefill (depths)."""
        if self.drafter is None:
            return 1.0
        mine = len(getattr(getattr(self.drafter, "meta", None), "layers", ()) or ())
        theirs = getattr(self.target.model.config, "num_hidden_layers", 0)
        return min(mine / theirs, 1.0) if mine and theirs else 1.0

    # ----- the scheduler ----------------------------------------------------------------
    def scheduler(
        self, max_batch: int | None = None, prefill: PrefillBudget | None = None
    ) -> Scheduler:
        """The engine's one scheduler, built on first use (``max_batch`` and ``prefill`` only
        count then). Not thread-safe: one thread steps it (the CLI's, or the service's engine
        thread)."""
        if self._scheduler is None:
            model = self.target.model
            limit = (self.model_cfg.max_kv_tokens if self.model_cfg else None) or default_kv_tokens(
                model
            )
            self._scheduler = Scheduler(
                model,
                self.target.eos_token_ids,
                self._proposer_for,
                block_size=self.block_size,
                max_batch=max_batch or 32,
                max_kv_tokens=limit,
                prefix_cache=self.prefix_cache,
                prefill=prefill,
                clock=self.clock,
                after_step=self._after_step,
                backend=self.backend,
            )
        return self._scheduler

    def capture(self) -> tuple[int, float]:
        """Every step graph the scheduler's target can take before serving (the cuda backend's,
        where one per rows bucket and width serves every context: no request then waits for a
        capture); how many it took and the seconds it took, on the engine's clock."""
        t0 = self.clock.now()
        captured = self.scheduler().target.capture()
        return captured, self.clock.now() - t0

    def _proposer_for(self, req: GenRequest) -> Proposer:
        if req.mode == "auto" and not req.sampling.greedy and req.sampling.seed is not None:
            # A seed asks for the same text again. Sampling stays exact in every mode, but which
            # random draws a request makes depends on its rounds, and auto's rounds follow
            # costs that change between requests: a seeded sampled request decodes plainly.
            return ArProposer()
        proposer = self.proposer(req.mode, req.max_new_tokens, req.copy)
        if isinstance(self.drafter, ReplayDrafter):  # the instrument: records ar, checks the rest
            return self.drafter.for_request(req, proposer)
        return proposer

    def record(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
    ) -> list[list[int]]:
        """Record the target's greedy output after each prompt for the replay instrument
        (:mod:`d3d.replay`): ``ar`` requests through the scheduler, all together (the replay
        drafter keeps what they commit). Returns the outputs. Call it from the thread that
        steps the scheduler."""
        if not isinstance(self.drafter, ReplayDrafter):
            raise DrafterError(
                "recording needs an engine whose drafter is a replay spec (replay:TAU)"
            )
        sched = self.scheduler()
        outs: list[list[int]] = [[] for _ in prompts]
        errors: list[BaseException] = []

        def done(_stats: DecodeStats, error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)

        s = sampling or SamplingConfig()
        for prompt, out in zip(prompts, outs, strict=True):
            sched.add(GenRequest(list(prompt), max_new_tokens, s, "ar", on_tokens=out.extend,
                                 on_finish=done))  # fmt: skip
        while not sched.idle:
            sched.step()
        if errors:
            raise errors[0]
        return outs

    def _after_step(self, rows: Sequence[Row]) -> None:
        """A step's commits are observed: give the target the cores its next step should have
        (fewer while the drafter process drafts), then send the worker every row's commit."""
        self.cpu_budget(any(getattr(r.proposer, "speculating", False) for r in rows))
        if self._batched is not None:
            self._batched.flush()

    def cache_prefix(self, ids: Sequence[int]) -> None:
        """Read a prompt prefix that requests will share into :attr:`prefix_cache` (unless it
        is there), e.g. beside other work before the request that needs it."""
        self.scheduler().encode_prefix(list(ids))

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat_template)

    def stream(
        self,
        prompt_ids: Sequence[int],
        cfg: DecodeConfig,
        stats: DecodeStats | None = None,
        draft_prompt_ids: Sequence[int] | None = None,
        shared_prefix: int = 0,
    ) -> Iterator[list[int]]:
        """Token chunks as the rounds commit them; ``stats`` is complete when this ends.

        ``draft_prompt_ids``: what the drafter reads as the prompt, when it differs from the
        target's (e.g. the whole document, while the target reads the kept part).
        ``shared_prefix``: how many first prompt tokens other requests share (their KV is kept
        in :attr:`prefix_cache`). Raises ValueError at once for a request that cannot run.
        """
        req = GenRequest.of(prompt_ids, cfg, stats, draft_prompt_ids, shared_prefix)
        sched = self.scheduler()
        sched.check(req)
        return stream(sched, req)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        cfg: DecodeConfig,
        draft_prompt_ids: Sequence[int] | None = None,
        shared_prefix: int = 0,
    ) -> Generation:
        stats = DecodeStats(mode=cfg.mode)
        chunks = self.stream(prompt_ids, cfg, stats, draft_prompt_ids, shared_prefix)
        ids = [t for chunk in chunks for t in chunk]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(text=text, token_ids=ids, stats=stats)

    def generate(self, prompt: str, cfg: DecodeConfig) -> Generation:
        return self.generate_ids(self.encode(prompt, cfg.chat_template), cfg)
