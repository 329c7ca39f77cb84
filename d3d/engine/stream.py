"""One request driven through the scheduler in the caller's thread: a generator of token chunks.

``d3d generate``, ``d3d qa`` and the evaluation harnesses decode this way: the request joins the
engine's :class:`~d3d.engine.scheduler.Scheduler` (a batch of one, or more if the caller added
others) and the caller steps it until the request ends, receiving each step's tokens as they
commit. Closing the generator early cancels the request (its proposer is closed, its KV freed);
an error that ended it is raised here.

:func:`decode` is the same for a bare model and one proposer (tests, benchmarks): a scheduler
of its own, every request given that proposer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from d3d.backends.sizes import window as model_window
from d3d.config import DecodeConfig
from d3d.decoding.proposers import Proposer
from d3d.decoding.stats import DecodeStats
from d3d.engine.kv_store import PrefixCache
from d3d.engine.request import GenRequest
from d3d.engine.scheduler import Scheduler


def stream(scheduler: Scheduler, req: GenRequest) -> Iterator[list[int]]:
    """Step ``scheduler`` until ``req`` ends, yielding its token chunks (see the module docstring).
    ``req``'s own callbacks are replaced."""
    chunks: list[list[int]] = []
    ended: list[BaseException | None] = []
    req.on_tokens = chunks.append
    req.on_finish = lambda _stats, error: ended.append(error)
    scheduler.add(req)
    try:
        while not ended:
            scheduler.step()
            while chunks:
                chunk = chunks.pop(0)
                if chunk:
                    yield chunk
    finally:
        if not ended:  # the consumer left early
            req.cancel()
            while not ended:
                scheduler.step()
    if ended[0] is not None:
        raise ended[0]


def decode(
    model,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    cfg: DecodeConfig,
    eos_ids: set[int],
    stats: DecodeStats | None = None,
    draft_prompt_ids: Sequence[int] | None = None,
    shared_prefix: int = 0,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[list[int]]:
    """Generate after ``prompt_ids`` with ``proposer`` on a scheduler of its own, yielding the
    tokens each round commits; ``stats`` is complete when the generator ends."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    window = model_window(model.config) or 1 << 16  # one stream's KV: its window
    scheduler = Scheduler(
        model,
        eos_ids,
        lambda _req: proposer,
        block_size=cfg.block_size,
        max_batch=1,
        max_kv_tokens=len(prompt_ids) + cfg.max_new_tokens + cfg.block_size + 16,
        prefix_cache=prefix_cache,
        window=window,
    )
    req = GenRequest.of(prompt_ids, cfg, stats, draft_prompt_ids, shared_prefix, mode=proposer.name)
    return stream(scheduler, req)
