"""D3D as a vLLM speculative proposer: ``speculative_config={"method": "custom_class",
"model": "d3d.vllm.D3DProposer", "num_speculative_tokens": 15}``.

vLLM (pinned: :data:`d3d.vllm.VLLM_VERSION`) builds this class in its model-runner process with
the ``VllmConfig``, calls ``load_model(target)`` once, and after every step's sampling calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``, expecting at most K
draft ids per row of its input batch. This adapter holds no rule of its own:

- the drafter runs in its own process (:class:`~d3d.worker.workers.ProcessWorker`: started with
  ``subprocess``, since vLLM's runner is a daemon process that may not start multiprocessing
  children) on its own device (``D3D_DRAFTER_DEVICE``: ``cuda:1`` on a GPU host; here
  ``cpu:1``, whose core vLLM is then started off (:mod:`d3d.vllm.engine`); by default on the
  cores vLLM's CPU build computes on too, where no branch fits beside its verification, as the
  proposer says at load), under a
  :class:`~d3d.worker.supervisor.Supervisor` that replaces it when it dies or hangs; only token
  ids cross;
- each request's proposer is the project's own (:mod:`d3d.worker.modes`): ``ar``, ``sync`` (the
  worker drafts on receipt of the commit), ``async`` (after answering a step, the worker
  prepares the next step's branches while vLLM verifies: hits answered at once, misses drafted
  then), ``auto`` (speculation and copy rounds only where the measured costs say they pay; no
  draft otherwise). The mode is the request's ``extra_args["d3d_mode"]`` (vLLM's OpenAI server:
  ``"vllm_xargs": {"d3d_mode": "async"}``), else ``D3D_VLLM_MODE`` (default ``auto``);
- :class:`~d3d.vllm.rows.RequestRows` keys sessions by request id (row i is the runner's
  ``input_batch.req_ids[i]``) and resynchronises them from the token ids, since vLLM says
  nothing of requests joining, finishing, being preempted or resuming.

vLLM verifies drafts without their probabilities. On vLLM's CPU build (0.32) that verification
does not keep a sampled request's distribution (``tests/vllm/test_vllm_sampling.py``; measured:
docs/results.md, "Figures from the code's docstrings"), so there the proposer drafts for greedy
requests only and sampled ones decode plainly (exact); on CUDA (vLLM's Triton kernels) sampled
requests speculate too.

A step in which no row drafts (every ``ar`` row, ``auto`` where speculation does not pay) takes
vLLM's plain path, not its speculative one with nothing to verify (:mod:`d3d.vllm.plain_steps`),
and vLLM's engine core does not ask for its (empty) drafts after it (:mod:`d3d.vllm.draft_fetch`;
the totals count the round trips made, ``draft_fetches``).

A failure of the drafter (dead, hung, garbage) costs a request its speculation, never its
answer: the proposer returns no draft for it, and any error inside this adapter returns no draft
for the step. With tensor parallelism only rank 0 drafts (vLLM takes the drafts from it).
``D3D_VLLM_STATS`` (a socket path) serves per-request and total figures to the server
(:mod:`d3d.vllm.stats`); ``D3D_BRANCHES`` fixes the branches per round (default: as many as fit
in the verification); ``D3D_WORKER_HANG_S``: a worker silent this long is replaced (5);
``D3D_READER`` (JSON, :class:`~d3d.worker.reading.ReaderSpec`): the worker also reads the
service's ``/qa`` documents, so that the drafter exists once. The target's spec for the drafter
is ``D3D_TARGET`` (default: the model vLLM serves); the drafter is ``D3D_DRAFTER`` (default:
``default``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from dataclasses import dataclass

from d3d.config import ConfigError, ModelConfig
from d3d.decoding.lookup import CopyDrafts
from d3d.decoding.policy import HostCosts
from d3d.decoding.stats import DecodeStats
from d3d.engine.loading import DrafterFactory
from d3d.engine.placement import parse_cores
from d3d.vllm import draft_fetch, patches, plain_steps
from d3d.vllm.rows import RequestRows, RowView
from d3d.vllm.stats import StatsServer
from d3d.worker.modes import MODES, ModeKit
from d3d.worker.proposer import BatchedLink
from d3d.worker.reading import READER_ENV, ReaderSpec
from d3d.worker.server import ServerConfig
from d3d.worker.supervisor import Supervisor, SupervisorConfig
from d3d.worker.workers import ProcessWorker, available_cores

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposerSettings:
    """The adapter's settings, from ``D3D_*`` variables (see the module docstring)."""

    mode: str = "auto"
    stats_path: str | None = None
    copy: bool = True
    hang_s: float = 5.0
    branches: int | None = None  # a fixed number of branches per round (None: the budget's)
    reader: ReaderSpec | None = None  # the worker reads the service's documents too

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                f"D3D_VLLM_MODE: must be one of {', '.join(MODES)}, got {self.mode!r}"
            )
        if self.hang_s <= 0:
            raise ConfigError(f"D3D_WORKER_HANG_S: must be > 0, got {self.hang_s}")
        if self.branches is not None and self.branches < 0:
            raise ConfigError(f"D3D_BRANCHES: must be >= 0, got {self.branches}")

    @classmethod
    def from_env(cls) -> ProposerSettings:
        env = os.environ
        return cls(
            mode=env.get("D3D_VLLM_MODE", "auto"),
            stats_path=env.get("D3D_VLLM_STATS") or None,
            copy=env.get("D3D_COPY", "1").strip().lower() not in ("0", "false", "no", "off"),
            hang_s=float(env.get("D3D_WORKER_HANG_S", "5")),
            branches=int(env["D3D_BRANCHES"]) if env.get("D3D_BRANCHES") else None,
            reader=_reader_spec(env.get(READER_ENV)),
        )


def _reader_spec(text: str | None) -> ReaderSpec | None:
    if not text:
        return None
    try:
        return ReaderSpec.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{READER_ENV}: not a reader spec ({exc})") from None


def external_id(req_id: str) -> str:
    """The id a client gave (vLLM appends ``-`` and 8 characters to make it unique)."""
    return req_id[:-9] if len(req_id) > 9 and req_id[-9] == "-" else req_id


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (tests), or another layout: one rank
        return 0


def cores_shared_with_vllm(cores: list[int] | None) -> list[int]:
    """Which of the drafter's ``cores`` (those it was given, else those it inherits from the
    calling thread) vLLM's CPU build computes on too, from the binding it was started with
    (``VLLM_CPU_OMP_THREADS_BIND``; none where that is not a core list)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    try:
        vllm = {c for part in bind.split("|") for c in parse_cores(part)}
    except ValueError:  # "auto", "nobind", unset: not known here
        return []
    return sorted(vllm.intersection(cores or ()))


def worker_cores(device: str | None) -> list[int] | None:
    """The CPU cores of a drafter process: ``cpu:CORES`` as given, else the last core when
    there are two or more (None: a GPU drafter, or one core)."""
    if device and device.startswith("cuda"):
        return None
    if device and device.startswith("cpu:"):
        return list(parse_cores(device[4:]))
    cores = available_cores()
    return [cores[-1]] if len(cores) >= 2 else None


class D3DProposer:
    """vLLM's ``custom_class`` proposer (see the module docstring)."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.target_layers = int(
            getattr(vllm_config.model_config.hf_config, "num_hidden_layers", 0) or 0
        )
        self.served = str(vllm_config.model_config.model)
        self.runner = patches.find_runner()
        self.settings = ProposerSettings.from_env()
        self.rows: RequestRows | None = None
        self.supervisor: Supervisor | None = None
        self.stats_server: StatsServer | None = None
        self.totals = DecodeStats(mode="all")
        self.errors = 0
        self.sampled_speculate = not patches.cpu_platform()  # see the module docstring
        if self.runner is None:
            log.error("D3D proposer: vLLM's model runner not found; no drafts (vLLM changed?)")
        self.paths = plain_steps.install(self.runner)  # None where not installed
        self.fetches = patches.count_take_drafts(self.runner)
        self.flag: draft_fetch.DraftFlag | None = None

    # ----- vLLM's calls -----------------------------------------------------------------------
    def load_model(self, target=None) -> None:
        """Start the drafter worker (rank 0 only); vLLM passes its target, which is not read."""
        if self.runner is None or _tp_rank() != 0 or self.rows is not None:
            return
        env_target = os.environ.get("D3D_TARGET")
        cfg = ModelConfig.from_env(target=env_target or self.served)
        device = cfg.drafter_device or "cpu"
        torch_device = device if device.startswith("cuda") else "cpu"
        cores = worker_cores(cfg.drafter_device)
        log.info(
            "D3D proposer: drafter %s of %s on %s%s, K=%d, default mode %s",
            cfg.drafter,
            cfg.target,
            torch_device,
            f" (cores {cores})" if cores else "",
            self.k,
            self.settings.mode,
        )
        if torch_device == "cpu" and (shared := cores_shared_with_vllm(cores or available_cores())):
            log.warning(
                "D3D proposer: vLLM computes on the drafter's core(s) %s too, so no branch fits "
                "beside its verification (async rounds draft on the commit, as sync); "
                "--drafter-device cpu:N gives the drafter cores of its own",
                shared,
            )
        factory = DrafterFactory(cfg, torch_device)
        server = ServerConfig(fixed_branches=self.settings.branches)
        reader = self.settings.reader
        self.supervisor = Supervisor(
            lambda: ProcessWorker(factory, cores, cfg=server, reader=reader),
            SupervisorConfig(hang_s=self.settings.hang_s),
        )
        self.link = BatchedLink(self.supervisor)
        self.host = HostCosts()
        self.kit = ModeKit(
            self.host,
            self.vocab_size,
            max_len=self.k,
            link=self.link,
            copies=self._copies if self.settings.copy else None,
        )
        self.rows = RequestRows(self._make, self.link.flush, self.k, totals=self.totals)
        flag_path = os.environ.get(draft_fetch.ENV)
        if flag_path:
            try:
                self.flag = draft_fetch.DraftFlag(flag_path, writer=True)
            except OSError:
                log.exception("D3D proposer: no draft flag; vLLM fetches drafts every step")
        if self.settings.stats_path:
            try:
                self.stats_server = StatsServer(self.settings.stats_path, self._answer)
            except OSError:  # a folder others may enter (d3d.worker.private): no figures
                log.exception("D3D proposer: no statistics socket at %s", self.settings.stats_path)
        atexit.register(self.close)

    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_
    ) -> list[list[int]]:
        """Drafts for every row of vLLM's input batch (``[]``: none)."""
        n = len(sampled_token_ids)
        if self.rows is None:
            return [[] for _ in range(n)]
        try:
            drafts = self.rows.step(
                self._views(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
            )
        except Exception:  # never fail vLLM's step: this step goes without drafts
            self.errors += 1
            log.exception("D3D proposer: a step failed; no drafts this step")
            drafts = [[] for _ in range(n)]
        if self.flag is not None:
            self.flag.set(any(drafts))
        return drafts

    # ----- helpers ----------------------------------------------------------------------------
    def _views(self, sampled, num_tokens, token_ids) -> list[RowView]:
        views = []
        rows = patches.row_requests(self.runner, len(sampled))
        for i, (s, row) in enumerate(zip(sampled, rows, strict=True)):
            rid, sp = row.req_id, row.sampling_params
            mode = ((getattr(sp, "extra_args", None) or {}).get("d3d_mode")) or self.settings.mode
            if not self.sampled_speculate and getattr(sp, "temperature", 0.0) > 0:
                mode = "ar"  # vLLM's CPU verification of sampled drafts is not exact
            length = int(num_tokens[i])
            budget = None
            prompt = row.prompt_token_ids
            if sp is not None and sp.max_tokens is not None and prompt is not None:
                budget = int(sp.max_tokens) - (length - len(prompt))
            ctx = token_ids[i, :length].tolist() if s and mode != "ar" else ()
            views.append(RowView(external_id(rid), mode, ctx, list(s), budget))
        return views

    def _make(self, mode: str, budget: int | None):
        if mode not in MODES:
            log.warning("D3D proposer: unknown mode %r, using %s", mode, self.settings.mode)
            mode = self.settings.mode
        self.kit.read_cost = self._read_cost()
        return self.kit.proposer(mode, budget, copy=self.settings.copy)

    def _copies(self) -> CopyDrafts:
        return CopyDrafts(self.host.copy, max_len=self.k, vocab_size=self.vocab_size)

    def _read_cost(self) -> float:
        layers = (self.supervisor.info if self.supervisor else {}).get("layers") or 0
        return min(layers / self.target_layers, 1.0) if layers and self.target_layers else 1.0

    def _answer(self, question: tuple) -> object:
        kind = question[0]
        if kind == "request":
            return self.rows.stats(str(question[1])) if self.rows is not None else None
        if kind == "totals":
            out = self.totals.to_dict()
            out["worker"] = self.supervisor.status() if self.supervisor else None
            out["resyncs"] = self.rows.resyncs if self.rows else 0
            out["errors"] = self.errors
            if self.paths is not None:
                out["plain_steps"] = self.paths.plain
                out["speculative_steps"] = self.paths.speculative
            if self.fetches is not None:
                out["draft_fetches"] = self.fetches[0]
            return out
        raise ValueError(f"unknown question {kind!r}")

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
        if self.supervisor is not None:
            self.supervisor.close()
        if self.stats_server is not None:
            self.stats_server.close()
        if self.flag is not None:
            self.flag.close()
