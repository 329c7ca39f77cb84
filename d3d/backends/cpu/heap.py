"""Freed memory kept in the process's heap (glibc), so a CPU forward's large activations reuse
pages instead of faulting in fresh ones.

glibc serves an allocation above its mmap threshold (128 KiB at first, raised as large blocks are
freed, to at most 32 MiB) with a fresh ``mmap`` and unmaps it on ``free``; the heap's top is also
given back to the system past the trim threshold. A CPU forward over a long prompt chunk makes
tensors of 4-13 MB at almost every op (a 2,048-token chunk's MLP activation alone is 12.6 MB for
SmolLM2-135M), so the outputs of element-wise ops were freshly mapped memory whose every 4 KiB page
was zeroed by a page fault on first touch. Keeping freed memory makes a prompt forward's tokens
and its element-wise ops cheaper; a decode step's small tensors are unchanged
(measured: docs/results.md, "Figures from the code's docstrings").

:func:`keep_freed_memory` raises both thresholds (``mallopt``) once per process: memory freed by
one forward is reused by the next, at the cost of the process keeping its peak activation
memory (a few hundred MB at the largest chunk) instead of giving it back between forwards.
Nothing changes where the C library is not glibc (musl, macOS): the call reports False.

:func:`pretouch` faults pages in ahead of time and leaves them free in the heap. On this host the
first touch of memory the process has not used before grows costly once a few GB are in use (the
host backs guest memory on first touch), and a burst of requests allocates the KV slabs of all
its rows in one step, which then stalls on those page faults
(measured: docs/results.md, "Figures from the code's docstrings"). The service therefore touches
its working KV memory at warm-up, as vLLM touches the KV cache it allocates at start; the slabs
of the burst then reuse those pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import time

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30

CHUNK = 16 << 20  # pretouch's blocks: under the mmap threshold, so they come from the heap

_done: bool | None = None
_mallopt = None


def keep_freed_memory() -> bool:
    """Keep freed blocks up to 32 MiB in the heap and stop trimming it (module docstring);
    True where glibc took the settings. Idempotent."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return _done
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    global _mallopt
    _mallopt = mallopt if _done else None
    log.debug("freed memory kept in the heap: %s", _done)
    return _done


def pretouch(nbytes: int) -> float | None:
    """Fault ``nbytes`` of heap memory in now and leave it free in the heap for what the process
    allocates next (module docstring); the seconds it took, or None where freed memory is not
    kept (not glibc). The trim threshold is raised to keep it."""
    if not keep_freed_memory() or nbytes <= 0:
        return None
    t0 = time.perf_counter()
    _mallopt(M_TRIM_THRESHOLD, max(TRIM_THRESHOLD, min(2 * nbytes, 2**31 - 1)))
    blocks = [torch.empty(CHUNK // 4) for _ in range(-(-nbytes // CHUNK))]
    with torch.inference_mode():
        torch._foreach_zero_(blocks)
    del blocks
    return time.perf_counter() - t0
