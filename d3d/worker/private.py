"""Private folders for the files two of the server's processes share (a socket, a flag).

vLLM's runner process, the drafter worker and the server talk through files: the proposer's
statistics socket (:mod:`d3d.vllm.stats`), the draft flag (:mod:`d3d.vllm.draft_fetch`) and the
drafter worker's reading socket (:mod:`d3d.worker.reading`). All live in a folder
only their owner can enter: one the server makes with :func:`make` (``mkdtemp``: mode 0700,
owned by this user, a fresh name) and removes with :func:`remove` when it stops, or one an
operator names, which :func:`check` accepts only when it is a real folder (no symlink) owned by
this user that no one else may read, write or enter. A path anywhere else is refused: another
user could have put a socket or a symlink there, or could read what is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import struct
import tempfile

PREFIX = "d3d-vllm-"


class NotPrivateError(PermissionError):
    """A folder that other users could enter or that is not ours."""


def make(prefix: str = PREFIX) -> str:
    """A new folder only this user can enter (mode 0700)."""
    return tempfile.mkdtemp(prefix=prefix)


def check(folder: str) -> None:
    """Raise :class:`NotPrivateError` unless ``folder`` is a private folder of this user."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise NotPrivateError(f"{folder}: no such folder") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivateError(f"{folder}: not a folder (a symlink or a file)")
    if st.st_uid != os.getuid():
        raise NotPrivateError(f"{folder}: owned by uid {st.st_uid}, not this user")
    if st.st_mode & 0o077:
        raise NotPrivateError(
            f"{folder}: mode {stat.S_IMODE(st.st_mode):04o} lets other users in (chmod 700 it)"
        )


def check_parent(path: str) -> str:
    """The folder of ``path``, checked with :func:`check`."""
    folder = os.path.dirname(os.path.abspath(path))
    check(folder)
    return folder


def remove(folder: str | None) -> None:
    """Remove a folder :func:`make` made, with what is in it (gone already: nothing to do)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def listen(path: str, backlog: int) -> socket.socket:
    """A Unix socket listening at ``path`` (mode 0600) in a private folder: a stale socket
    there is replaced, anything else there is refused (:class:`NotPrivateError`)."""
    check_parent(path)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise NotPrivateError(f"{path}: exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return sock


def connect(path: str, timeout: float | None = None) -> socket.socket:
    """A Unix socket connected to ``path`` in a private folder (:class:`NotPrivateError`
    otherwise; ``timeout``: each call on it gives up after that many seconds)."""
    check_parent(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def peer_is_us(conn: socket.socket) -> bool:
    """Whether the process at the other end of ``conn`` runs as this user (``SO_PEERCRED``)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()
