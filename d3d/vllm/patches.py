"""Every touch of vLLM's internals, behind one version gate.

The D3D proposer lives inside vLLM (pinned :data:`d3d.vllm.VLLM_VERSION`) through its public
``custom_class`` hook, but three things it needs vLLM does not offer, so it patches three
methods, and it reads the model runner's private state. All of it is here, nowhere else:

Patches
  1. ``EngineCore.post_step`` (class-wide, from the general plugin :func:`wrap_post_step`): the
     draft round trip after a step is skipped when the step made no drafts.
  2. ``<runner>._prepare_inputs`` (one runner instance, :func:`wrap_prepare_inputs`): a step in
     which no row carries a draft runs with ``speculative_config`` hidden (the plain sampler).
  3. ``<runner>.take_draft_token_ids`` (one runner instance, :func:`count_take_drafts`): counts
     the round trips made.
Reads
  - the model runner: the caller up the stack when vLLM builds the proposer (:func:`find_runner`);
  - ``runner.input_batch.req_ids`` and ``runner.requests[rid]`` (``sampling_params``,
    ``prompt_token_ids``) for each row of a step (:func:`row_requests`);
  - ``runner.speculative_config`` and ``runner.model_config.is_hybrid`` (patch 2);
  - ``core.vllm_config`` (``speculative_config``, ``parallel_config.data_parallel_size``) and
    ``core.async_scheduling`` (patch 1, :func:`core_settings`).

:data:`NEEDS` lists what each touch needs of vLLM's classes; :func:`missing` checks the installed
vLLM against it (and the CPU kernels the CPU backend calls, :mod:`d3d.backends.cpu.vllm_kernels`)
and names each gap. The patches refuse to install on another vLLM version or where something is
missing (a warning, and vLLM's own path: slower, never wrong); the tests call :func:`missing` and
fail, not skip, so an upgrade cannot pass CI with a fast path silently gone. Moving to a new vLLM
version: docs/service.md, "Moving to another vLLM".
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from d3d.vllm import VLLM_VERSION

log = logging.getLogger(__name__)

MARK = "_d3d_wrapped"  # set on a wrapped post_step: a second plugin load leaves it alone

# What each touch point needs: (the import path of a vLLM class, an attribute it must have, why).
# Instance attributes set in __init__ are checked in the source of __init__.
NEEDS: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.engine.core:EngineCore", "post_step", "patch 1: skip empty draft round trips"),
    ("vllm.v1.engine.core:EngineCore", "self.async_scheduling", "patch 1: async engines excluded"),
    ("vllm.v1.engine.core:EngineCore", "self.vllm_config", "patch 1: the speculative config"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_prepare_inputs", "patch 2: plain steps"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "self.speculative_config", "patch 2"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "take_draft_token_ids", "patch 3: counts"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "self.input_batch", "rows of a step"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "self.requests", "rows' requests"),
    ("vllm.v1.worker.gpu_input_batch:InputBatch", "req_ids", "a row's request id"),
    ("vllm.v1.worker.gpu_input_batch:CachedRequestState", "sampling_params", "a row's mode"),
    ("vllm.v1.worker.gpu_input_batch:CachedRequestState", "prompt_token_ids", "a row's budget"),
)


def _resolve(path: str) -> object:
    module, _, name = path.partition(":")
    obj = __import__(module, fromlist=[name])
    return getattr(obj, name)


def _has(cls: object, attr: str) -> bool:
    if not attr.startswith("self."):
        return hasattr(cls, attr) or attr in getattr(cls, "__dataclass_fields__", {})
    try:
        source = inspect.getsource(cls.__init__)  # type: ignore[misc]
    except (OSError, TypeError):
        return False
    return f"{attr} =" in source or f"{attr}:" in source


def missing() -> list[str]:
    """What the installed vLLM lacks of what the project touches, one line each naming the
    class or kernel, the attribute and the touch (empty: all there): :func:`missing_touches`,
    and on vLLM's CPU build the kernels the CPU backend calls. Raises ImportError where vLLM
    is not installed."""
    gaps = missing_touches()
    if cpu_platform():
        from d3d.backends.cpu import vllm_kernels

        gaps += [f"CPU kernel {k}: missing — the CPU backend's fast path" for k in
                 vllm_kernels.missing()]  # fmt: skip
    return gaps


def missing_touches(needs: tuple[tuple[str, str, str], ...] = NEEDS) -> list[str]:
    """What the installed vLLM lacks of what the patches and reads need (:data:`NEEDS`); a
    version other than the pinned one is a gap too."""
    gaps = []
    if version() != VLLM_VERSION:
        gaps.append(f"vLLM {version()} is not the pinned {VLLM_VERSION}")
    for path, attr, why in needs:
        try:
            cls = _resolve(path)
        except (ImportError, AttributeError) as exc:
            gaps.append(f"{path}: cannot import ({exc}) — {why}")
            continue
        if not _has(cls, attr):
            gaps.append(f"{path}.{attr.removeprefix('self.')}: missing — {why}")
            continue
        if attr == "_prepare_inputs":
            first = list(inspect.signature(cls._prepare_inputs).parameters)[1:2]  # type: ignore[attr-defined]
            if first != ["scheduler_output"]:
                gaps.append(f"{path}._prepare_inputs: its first argument is not scheduler_output")
    return gaps


def version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def cpu_platform() -> bool:
    """Whether vLLM runs on its CPU build here (False where vLLM is absent)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # no platform: not a CPU build
        return False


def _usable(touch: str) -> bool:
    """Whether patches may be installed: the pinned version, nothing missing (else a warning
    naming what, once per touch)."""
    gaps = missing_touches()
    if gaps:
        log.warning("D3D: %s left as vLLM's own: %s", touch, "; ".join(gaps))
    return not gaps


# ----- patch 1: EngineCore.post_step --------------------------------------------------------
@dataclass(frozen=True)
class CoreSettings:
    """What patch 1 reads of an engine core."""

    method: str | None  # the speculative method (None: no speculation)
    model: str | None  # its proposer class path
    async_scheduling: bool
    data_parallel: int


def core_settings(core: object) -> CoreSettings:
    cfg = getattr(core, "vllm_config", None)
    spec = getattr(cfg, "speculative_config", None)
    return CoreSettings(
        method=getattr(spec, "method", None),
        model=getattr(spec, "model", None),
        async_scheduling=bool(getattr(core, "async_scheduling", False)),
        data_parallel=int(getattr(getattr(cfg, "parallel_config", None), "data_parallel_size", 1)),
    )


def wrap_post_step(skip: Callable[[object, bool], bool]) -> bool:
    """Patch 1: ``EngineCore.post_step`` returns at once where ``skip(core, model_executed)``
    says so (the step made no drafts), else runs vLLM's. False where not installed."""
    from vllm.v1.engine.core import EngineCore

    if getattr(getattr(EngineCore, "post_step", None), MARK, False):
        return True  # loaded twice in one process
    if not _usable("EngineCore.post_step"):
        return False
    post_step = EngineCore.post_step

    @functools.wraps(post_step)
    def wrapped(core, model_executed: bool) -> None:
        if skip(core, model_executed):
            return None
        return post_step(core, model_executed)

    setattr(wrapped, MARK, True)
    EngineCore.post_step = wrapped
    return True


# ----- patch 2: <runner>._prepare_inputs ----------------------------------------------------
def wrap_prepare_inputs(runner: object, plain: Callable[[object], bool]) -> bool:
    """Patch 2: ``runner._prepare_inputs(scheduler_output, ...)`` runs with the runner's
    ``speculative_config`` hidden where ``plain(scheduler_output)`` says the step carries no
    draft. False where not installed (no runner, a hybrid model, another vLLM)."""
    prepare = getattr(runner, "_prepare_inputs", None)
    if prepare is None or getattr(getattr(runner, "model_config", None), "is_hybrid", False):
        return False
    if not _usable("_prepare_inputs"):
        return False

    @functools.wraps(prepare)
    def prepare_inputs(scheduler_output, *args, **kwargs):
        spec = runner.speculative_config  # type: ignore[attr-defined]
        if spec is None or not plain(scheduler_output):
            return prepare(scheduler_output, *args, **kwargs)
        runner.speculative_config = None  # type: ignore[attr-defined]
        try:
            return prepare(scheduler_output, *args, **kwargs)
        finally:
            runner.speculative_config = spec  # type: ignore[attr-defined]

    runner._prepare_inputs = prepare_inputs  # type: ignore[attr-defined]
    return True


def has_drafts(scheduler_output: object) -> bool:
    """Whether a step's scheduler output gives any row a draft to verify."""
    return bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", None))


# ----- patch 3: <runner>.take_draft_token_ids -----------------------------------------------
def count_take_drafts(runner: object | None) -> list[int] | None:
    """Patch 3: count ``runner.take_draft_token_ids`` calls in a one-item list (None where the
    runner has no such method)."""
    take = getattr(runner, "take_draft_token_ids", None)
    if take is None:
        return None
    calls = [0]

    @functools.wraps(take)
    def counted(*args, **kwargs):
        calls[0] += 1
        return take(*args, **kwargs)

    runner.take_draft_token_ids = counted  # type: ignore[union-attr]
    return calls


# ----- reads --------------------------------------------------------------------------------
def find_runner() -> object | None:
    """vLLM's model runner: the caller up the stack (it builds its drafter in ``__init__``)."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and type(obj).__name__.endswith("ModelRunner"):
            return obj
        frame = frame.f_back
    return None


@dataclass(frozen=True)
class RowRequest:
    """What the proposer reads of one row's request in vLLM's runner."""

    req_id: str
    sampling_params: object | None
    prompt_token_ids: list[int] | None


def row_requests(runner: object, n: int) -> list[RowRequest]:
    """The requests of a step's first ``n`` rows, in the runner's row order."""
    batch, requests = runner.input_batch, runner.requests  # type: ignore[attr-defined]
    out = []
    for i in range(n):
        rid = batch.req_ids[i]
        state = requests.get(rid)
        out.append(
            RowRequest(
                rid,
                getattr(state, "sampling_params", None),
                getattr(state, "prompt_token_ids", None),
            )
        )
    return out
