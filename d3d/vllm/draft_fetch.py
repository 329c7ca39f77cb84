"""vLLM's engine core asks the model runner for drafts only after a step that made some.

With a speculative configuration and synchronous scheduling (always, for a ``custom_class``
proposer; vLLM's CPU platform schedules synchronously whatever the method), vLLM 0.32's engine
core follows every step with one more round trip to its model-runner process,
``take_draft_token_ids``, to hand the proposer's drafts to its scheduler. On this CPU that round
trip (``EngineCore.post_step``) is what the configuration costs a step, everything else it adds
within noise (measured: docs/results.md, "Figures from the code's docstrings"). ``auto`` drafts
nothing where speculation does not pay, and ``ar`` never drafts, so most of those round trips
fetched nothing.

Two halves, one per process:

- :class:`DraftFlag`, in the runner's process: the proposer writes one byte to a file after
  every call, 1 when some row of the step got a draft, 0 when none did (rank 0 only, which is
  where vLLM takes the drafts from). It is written before vLLM's runner answers the step, so the
  engine core, which reads it after that answer, sees this step's value.
- :func:`register`, vLLM's general plugin (entry point ``vllm.general_plugins``, loaded in every
  vLLM process): in the engine core it wraps ``EngineCore.post_step`` (the patch itself is in
  :mod:`d3d.vllm.patches`) so that the round trip is
  skipped when the byte is 0. Only an engine whose speculative method is the D3D proposer, with
  the flag's path in ``D3D_VLLM_DRAFT_FLAG`` (set by :func:`d3d.vllm.engine.prepare_env`), one
  data-parallel rank and the pinned vLLM version skips; for every other engine (vLLM alone in
  the same environment) the wrapper calls vLLM's own ``post_step`` at every step.

Skipping is lossless: the scheduler clears a request's drafts once it has scheduled them, so a
step with no drafts to hand over leaves it exactly as the round trip would have. A flag that
cannot be read (not written yet, gone) counts as "drafted" (the round trip happens); a stale 0
could only cost a step its drafts, never an answer.

The flag lies in the server's private folder beside the statistics socket
(:mod:`d3d.worker.private`), never in ``/tmp`` itself: both sides refuse a flag whose folder
another user could enter, the writer makes a new file there (``O_EXCL``, mode 0600) and neither
side follows a symlink (``O_NOFOLLOW``).
"""

from __future__ import annotations

import contextlib
import logging
import os

from d3d.vllm import patches
from d3d.worker import private

log = logging.getLogger(__name__)

ENV = "D3D_VLLM_DRAFT_FLAG"


class DraftFlag:
    """One byte in a file at ``path``: did the last step give any row a draft."""

    def __init__(self, path: str, *, writer: bool = False):
        self.path = path
        self.writer = writer
        self.fd: int | None = None
        self.written = True
        if writer:  # OSError (NotPrivateError among them): no flag
            private.check_parent(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale flag of an earlier runner (the folder is ours alone)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            self.fd = os.open(path, flags, 0o600)
            os.pwrite(self.fd, b"\x01", 0)

    def set(self, drafted: bool) -> None:
        """Write this step's value (the writer's side) when it changed; a failed write closes
        the flag."""
        if self.fd is None or drafted == self.written:
            return
        try:
            os.pwrite(self.fd, b"\x01" if drafted else b"\x00", 0)
            self.written = drafted
        except OSError:
            log.exception("D3D draft flag: write failed; the engine core keeps its round trip")
            self.close()

    def drafted(self) -> bool:
        """The last step's value (the reader's side); True when it cannot be read."""
        if self.fd is None:
            try:
                private.check_parent(self.path)
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return True
        try:
            return os.pread(self.fd, 1, 0) != b"\x00"
        except OSError:
            return True

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if self.writer:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def skip_empty(core: object, model_executed: bool) -> bool:
    """Whether ``core``'s round trip after this step can be skipped: its flag says the step made
    no drafts (the flag is found at the core's first step; none: never skip)."""
    flag = core.__dict__.get("_d3d_draft_flag", False)
    if flag is False:
        flag = core.__dict__["_d3d_draft_flag"] = flag_for(core)
    return flag is not None and model_executed and not flag.drafted()


def flag_for(core: object) -> DraftFlag | None:
    """The flag an engine core reads, None where its ``post_step`` stays vLLM's own."""
    from d3d.vllm import PROPOSER

    path = os.environ.get(ENV)
    got = patches.core_settings(core)
    if not path or got.method != "custom_class" or got.model != PROPOSER:
        return None
    if got.async_scheduling or got.data_parallel > 1:
        return None  # async: vLLM takes drafts in the runner; several ranks: one flag each
    log.info("D3D: draft round trips only after steps with drafts (flag %s)", path)
    return DraftFlag(path)


def register() -> None:
    """vLLM's general plugin: wrap ``EngineCore.post_step`` (:func:`d3d.vllm.patches.wrap_post_step`,
    see the module docstring). The wrapper decides per engine, at its first step, from that
    process's environment: vLLM may load its plugins in a process before the flag's path is set
    and fork its engine core after."""
    if not patches.wrap_post_step(skip_empty) and os.environ.get(ENV):
        log.warning("D3D: vLLM's post_step kept: every step makes its draft round trip")
