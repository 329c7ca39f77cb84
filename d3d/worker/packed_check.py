"""The packed drafter proves itself on a sample before a worker drafts through it.

The cuda backend readies a drafter for packed drafting (:func:`~d3d.backends.cuda.drafter.mark`);
before a worker's server (or the replay instrument's drafter shape) drafts that way,
:func:`proven_plan` runs a sample through the packed step — captured on a GPU, as the server will
run it — and through the row-by-row drafter, and compares each block's draft-space scores by
their largest relative difference (:func:`d3d.backends.check.relative_error`, within the
target's tolerance for the dtype). The sample is the server's two step forms over two rows of
different lengths: a miss's block after the row's unread chain, then two branches a row after a
chain of the anchor and K drafts, each branch seeing a different part of it. A sample that
disagrees or raises (a capture the device refused, a kernel that does not take the drafter's
shapes) leaves the worker drafting row by row, the reason logged; the verdict is kept per
drafter, so a process samples a drafter once.

Letters: K drafts a block, V_d draft vocabulary.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from d3d.backends import check
from d3d.backends.cuda.drafter import PackedDrafter, PackedPlan, plan_of
from d3d.backends.cuda.kv import MIN_CAPACITY
from d3d.model.drafter import D3DDrafter
from d3d.worker.drafting import draft_branches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """The sample's largest relative error, its tolerance, and why it did not run ('' if it
    did)."""

    error: float
    tolerance: float
    failed: str = ""

    @property
    def agrees(self) -> bool:
        return not self.failed and self.error <= self.tolerance


_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, Verdict] = weakref.WeakKeyDictionary()


def proven_plan(drafter: D3DDrafter) -> PackedPlan | None:
    """The packed plan the cuda backend left on ``drafter``, where its sample agrees (None: the
    worker drafts row by row)."""
    plan = plan_of(drafter)
    if plan is None:
        return None
    verdict = verdict_of(drafter, plan)
    if not verdict.agrees:
        log.warning("the packed drafter's sample %s: the worker drafts row by row",
                    f"failed ({verdict.failed})" if verdict.failed
                    else f"differs from the row-by-row drafter by {verdict.error:.2e} "
                    f"(> {verdict.tolerance:.0e})")  # fmt: skip
        return None
    return plan


def verdict_of(drafter: D3DDrafter, plan: PackedPlan) -> Verdict:
    """The sample's verdict for ``drafter`` (run once per drafter)."""
    if drafter.lm not in _VERDICTS:
        limit = check.tolerance(drafter.mask_embedding.dtype)
        try:
            _VERDICTS[drafter.lm] = Verdict(sample_error(drafter, plan), limit)
        except Exception as exc:  # the row-by-row drafter runs; the reason is logged
            log.exception("the packed drafter's sample raised")
            _VERDICTS[drafter.lm] = Verdict(float("inf"), limit, f"{type(exc).__name__}: {exc}")
    return _VERDICTS[drafter.lm]


@torch.inference_mode()
def sample_error(drafter: D3DDrafter, plan: PackedPlan, seed: int = 0) -> float:
    """The largest relative error of the packed step's blocks from the row-by-row drafter's,
    over the module docstring's sample."""
    p = PackedDrafter(drafter, replace(plan, rows=2, kv_tokens=2 * MIN_CAPACITY))
    kb, dev = drafter.block_size, drafter.device
    vocab = int(drafter.lm.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (7, 4)]
    rows = [p.open(64) for _ in ids]
    errors = []
    # a miss: each row's unread tokens as its chain, then its block
    visible = torch.tensor([[len(x) - 1] for x in ids], device=dev)
    anchors = torch.tensor([[x[-1]] for x in ids], device=dev)
    got = p.run(rows, [x[:-1] for x in ids], visible, anchors).blocks  # [2, 1, K, V_d]
    caches = [_cache(drafter, x[:-1]) for x in ids]  # a block leaves its cache as it was
    for i, x in enumerate(ids):
        want = drafter.block_scores(x[-1], caches[i])
        errors.append(check.relative_error(got[i, 0], want))
    # branches: the anchor and K drafts as the chain, two blocks a row seeing k_b of them
    chains = [[x[-1], *torch.randint(vocab, (kb - 1,), generator=gen).tolist()] for x in ids]
    ks = [[0, kb - 1], [kb // 2, 1]]
    visible = torch.tensor([[len(x) + k for k in kk] for x, kk in zip(ids, ks, strict=True)])
    anchors = torch.randint(vocab, (2, 2), generator=gen)
    got = p.run(rows, chains, visible.to(dev), anchors.to(dev)).blocks  # [2, 2, K, V_d]
    for i in range(len(ids)):
        want = draft_branches(
            drafter, caches[i], visible[i].tolist(), anchors[i].tolist(), chains[i]
        )
        errors.append(check.relative_error(got[i], want))
    for row in rows:
        p.close(row)
    return max(errors)


def _cache(drafter: D3DDrafter, ids: list[int]) -> DynamicCache:
    cache = DynamicCache()
    drafter.encode(ids, cache)
    return cache
