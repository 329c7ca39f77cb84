"""A backend proves itself against the reference on a sample at load.

:func:`sample_agrees` runs the same short schedule twice over two fresh KVs of the model's
shape — two rows over two steps (a prompt's chunk of 5 and 3 tokens, then 2 and 1 more) — once
through the reference forward (the model's own Hugging Face forward with PyTorch's attention)
and once through the backend's step, and compares every step's logits by their largest
relative difference (:data:`TOLERANCE`). A backend whose sample disagrees is not used: the
caller logs why and falls back to the reference.

Letters: V vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

TOLERANCE = 1e-4  # a sample's largest relative difference accepted (float32)
BF16_TOLERANCE = 3e-2  # the same in bfloat16 / float16, where summation order shows

log = logging.getLogger(__name__)

Step = Callable[[Sequence[Sequence[int]]], torch.Tensor]
"""One step of a sample: the two rows' new ids -> their logits, concatenated [T_0 + T_1, V]
(the step commits what it read)."""


def steps_of(target) -> Step:
    """The sample's steps on a step target (a :class:`~d3d.backends.target.BatchTarget` or
    any object with its ``kv`` and ``forward``), over two rows it opens."""
    rows = [target.kv.open(64), target.kv.open(64)]

    def step(ids: Sequence[Sequence[int]]) -> torch.Tensor:
        out = torch.cat(target.forward(rows, ids))
        for row, r in zip(rows, ids, strict=True):
            target.kv.commit(row, len(r))
        return out

    return step


SCHEDULE = ((5, 3), (2, 1))  # two rows' new tokens in each of two steps (a backend may add)


def sample_ids(
    vocab: int, schedule: Sequence[Sequence[int]] = SCHEDULE, seed: int = 0
) -> list[list[list[int]]]:
    """The sample's ids: per step, per row (``schedule``: each step's widths)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(vocab, (w,), generator=gen).tolist() for w in widths] for widths in schedule
    ]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of ``got`` from ``want``, relative to ``want``'s largest value."""
    want = want.float()
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6))


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE


def sample_error(
    model: PreTrainedModel, mine: Step, schedule: Sequence[Sequence[int]] = SCHEDULE
) -> float:
    """The largest :func:`relative_error` of the backend's steps (``mine``, e.g.
    :func:`steps_of` its target) from the reference's, step by step, on :func:`sample_ids` of
    ``schedule``."""
    from d3d.backends.kv import RowKV
    from d3d.backends.target import BatchTarget

    vocab = int(model.get_output_embeddings().weight.shape[0])
    ref = steps_of(BatchTarget(model, RowKV.for_model(model, 256)))
    return max(relative_error(mine(step), ref(step)) for step in sample_ids(vocab, schedule))


def sample_agrees(
    model: PreTrainedModel,
    mine: Step,
    name: str,
    schedule: Sequence[Sequence[int]] = SCHEDULE,
) -> bool:
    """Whether :func:`sample_error` is within the model's dtype's :func:`tolerance` (a log line
    says by how much it is not)."""
    err = sample_error(model, mine, schedule)
    limit = tolerance(next(model.parameters()).dtype)
    if not err <= limit:
        log.warning("the %s backend's sample differs from the reference by %.2e (> %.0e)",
                    name, err, limit)  # fmt: skip
        return False
    return True
