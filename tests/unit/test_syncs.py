"""The sync counter files torch's sync-debug warnings under the thread that made them, and
leaves the warnings machinery as it found it. Torch's debug mode itself needs CUDA, so here the
warnings are raised the way it raises them, from two threads."""

import threading
import warnings

import torch

from d3d.tools import syncs
from d3d.tools.syncs import SyncCounter

MESSAGE = "called a synchronizing CUDA operation"  # torch's words in its sync debug mode


def test_waits_are_counted_by_thread_and_other_warnings_still_show(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    before = warnings.showwarning
    shown = []
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
        with SyncCounter() as c:
            for _ in range(3):
                warnings.warn(MESSAGE, stacklevel=1)  # one place, counted each time
            worker = threading.Thread(
                target=lambda: [warnings.warn(MESSAGE, stacklevel=1) for _ in range(2)],
                name="d3d-drafter",
            )
            worker.start()
            worker.join()
            warnings.warn("something else", stacklevel=1)
            assert c.take() == 3 and c.take() == 0  # taken, then reset
            assert c.by_thread == {"d3d-drafter": 2}
        assert shown == ["something else"]  # only the waits are swallowed
    assert modes == ["warn", "default"] and warnings.showwarning is before


def test_nothing_is_counted_or_changed_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: 1 / 0)
    with SyncCounter() as c:
        assert c.take() == 0
    assert syncs.MARK in MESSAGE
