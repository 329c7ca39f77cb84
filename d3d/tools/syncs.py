"""Host-device synchronisations counted per thread, through torch's sync debug mode.

The cuda backend promises at most one device-to-host wait a decode step (the accepted tokens
coming back); every other wait stalls the host while the device drains. :class:`SyncCounter`
counts them: inside it, ``torch.cuda.set_sync_debug_mode("warn")`` makes each synchronising call
(a ``.item()``, ``.tolist()`` or ``.cpu()`` of a device tensor, a stream synchronise, a blocking
copy) raise a warning, which the counter files under the thread that made the call instead of
printing it. The engine's thread and a drafter worker's thread are counted apart.

Waits on CUDA events (the step clock's) are not synchronising calls in torch's sense and are not
counted. On a host without CUDA nothing synchronises and every count is 0. The counter changes
process-wide state (the debug mode, the warnings hook), so one runs at a time, around the code
being measured only.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter

import torch

MARK = "synchroniz"  # in every warning torch's sync debug mode gives


class SyncCounter:
    """``with SyncCounter() as c: ...`` then ``c.by_thread`` (thread name -> syncs) and
    :meth:`take` (the calling thread's count so far, reset)."""

    def __init__(self):
        self.by_thread: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._on = torch.cuda.is_available()

    def __enter__(self) -> SyncCounter:
        if not self._on:
            return self
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")  # a warning per call, not one per place
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if MARK in str(message):
                with self._lock:
                    self.by_thread[threading.current_thread().name] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if not self._on:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)  # the warnings hook and filters as they were

    def take(self) -> int:
        """Syncs made by the calling thread since its last take."""
        with self._lock:
            return self.by_thread.pop(threading.current_thread().name, 0)
