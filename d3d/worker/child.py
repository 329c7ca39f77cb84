"""``python -m d3d.worker.child FD``: a drafter worker process (see :mod:`d3d.worker.workers`).

Started by :class:`~d3d.worker.workers.ProcessWorker` with one end of a socket pair as file
descriptor ``FD``; the first message on it is a :class:`~d3d.worker.workers.ChildStart`.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def main(argv: list[str]) -> int:
    from d3d.worker.workers import child_main, recv

    conn = Connection(int(argv[0]))
    try:
        start = recv(conn, start=True)  # the parent's instruction: msgpack, never pickle
    except (EOFError, OSError):
        return 0
    except ValueError as exc:
        print(f"d3d.worker.child: {exc}", file=sys.stderr)
        return 2
    child_main(conn, start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
