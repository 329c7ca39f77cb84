"""The packed drafter's sample at load (d3d.worker.packed_check): it agrees with the row-by-row
drafter for every drafter form, and a packed step that disagrees or raises leaves the worker
drafting row by row, the reason logged."""

from __future__ import annotations

import logging

import pytest

from d3d.backends.cuda import CudaBackend
from d3d.backends.cuda.drafter import PackedPlan, mark
from d3d.backends.cuda.drafter_step import PackedForward
from d3d.worker import packed_check
from d3d.worker.packed import PackedDraftServer
from d3d.worker.server import DraftServer
from d3d.worker.workers import server_for
from tests.engine.test_cuda_drafter import drafter_of


@pytest.mark.parametrize("kind", ["llama", "plain", "adapters", "vocab"])
@pytest.mark.parametrize("graphs", [False, True])  # True: rehearsed here
def test_the_sample_agrees_for_every_drafter_form(kind, graphs):
    d = drafter_of(kind)
    err = packed_check.sample_error(d, PackedPlan(graphs=graphs))
    assert err < 1e-5


def test_a_readied_drafter_drafts_packed_once_its_sample_agrees():
    d = drafter_of("plain")
    assert isinstance(server_for(d), DraftServer)  # not readied
    CudaBackend(graphs=False).prepare_drafter(d.lm)
    assert isinstance(server_for(d), PackedDraftServer)
    assert packed_check.verdict_of(d, PackedPlan()).agrees


def test_a_packed_step_that_disagrees_drafts_row_by_row(monkeypatch, caplog):
    d = drafter_of("plain")
    mark(d.lm, PackedPlan(graphs=False))
    call = PackedForward.__call__
    monkeypatch.setattr(PackedForward, "__call__", lambda self, *a: call(self, *a) * 1.01)
    with caplog.at_level(logging.WARNING):
        server = server_for(d)
    assert type(server) is DraftServer
    assert "differs from the row-by-row drafter" in caplog.text
    assert not packed_check.verdict_of(d, PackedPlan()).agrees


def test_a_packed_step_that_raises_drafts_row_by_row(monkeypatch, caplog):
    d = drafter_of("plain")
    mark(d.lm, PackedPlan(graphs=False))

    def refused(self, *a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PackedForward, "__call__", refused)
    with caplog.at_level(logging.WARNING):
        assert type(server_for(d)) is DraftServer
    verdict = packed_check.verdict_of(d, PackedPlan())
    assert "not permitted" in verdict.failed and verdict.error == float("inf")
    assert "failed (RuntimeError" in caplog.text
    monkeypatch.undo()  # the verdict is kept: the drafter is not sampled again
    assert type(server_for(d)) is DraftServer
    assert packed_check.verdict_of(d, PackedPlan()).error == float("inf")
