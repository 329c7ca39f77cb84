"""Documents read in the drafter worker for the service, beside its drafting.

On a host served by vLLM the drafter exists once, in its worker process on its own device (its
own GPU, or its own cores). The service's ``/qa`` reading (the drafter scoring a document for a
question) runs there too, so that the API process holds no model at all: it sends a
:class:`Read` over a Unix socket and gets a :class:`ReadDone` back.

What reading means is not this module's business. A :class:`ReaderSpec` names, by import path,
a frozen dataclass of the project's packages whose fields are plain values (the worker codec's
rule for code that crosses: :mod:`d3d.worker.codec`); the worker builds it and calls it with its
drafter, which gives the reader: a function from a request's plain fields (a dict) to the
reply's (a dict). The service's reader is ``app.documents.WorkerReader``; nothing here imports
it, so ``d3d`` stays below ``compression`` and ``app``.

:class:`ReadServer` listens in threads of the worker process: the reader is built on the accept
thread (the drafter is ready and drafting meanwhile), each connection has a thread, and readings
run one at a time while the worker's main loop goes on drafting (torch lets go of the interpreter
inside its kernels; on a GPU the reading runs on a CUDA stream of its own). A reader that cannot
be built answers every request with why. The socket lies in the server's private folder
(:mod:`d3d.worker.private`) and only peers of this user are answered; messages are msgpack
(:data:`~d3d.worker.protocol.CODEC`), never pickle.

:class:`ReadClient` is the service's side: one connection, reopened once when the worker was
replaced; each reading waits at most ``timeout`` seconds. ``ConnectionError``: no worker is up to
read (it is starting or being replaced).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from d3d.worker import private
from d3d.worker.codec import CodecError, import_factory
from d3d.worker.protocol import CODEC

log = logging.getLogger(__name__)

MAX_READ = 256 * 1024 * 1024  # bytes of one request or reply (a document at the body limit fits)
BACKLOG = 8
READER_ENV = "D3D_READER"  # a ReaderSpec as JSON, for a worker started inside vLLM's runner
Reader = Callable[[dict], dict]


@CODEC.register
@dataclass(frozen=True)
class Read:
    """A document to read: ``args`` are the reader's (plain values)."""

    rid: int
    args: dict = field(default_factory=dict)


@CODEC.register
@dataclass(frozen=True)
class ReadDone:
    """The reader's reply to :class:`Read` ``rid``; ``{"error": kind, "message": text}`` when the
    reading failed."""

    rid: int
    result: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ReaderSpec:
    """How a worker builds its reader: ``factory`` (``module:Class``, a frozen dataclass of the
    project) built from ``fields`` and called with the drafter; ``path``: the socket."""

    factory: str
    fields: dict
    path: str

    def build(self, drafter: object) -> Reader:
        try:
            make = import_factory(self.factory)
        except CodecError as exc:
            raise ValueError(f"reader factory {self.factory!r}: {exc}") from None
        return make(**self.fields)(drafter)

    def to_dict(self) -> dict:
        return {"factory": self.factory, "fields": dict(self.fields), "path": self.path}

    @classmethod
    def from_dict(cls, data: dict) -> ReaderSpec:
        return cls(str(data["factory"]), dict(data.get("fields") or {}), str(data["path"]))


def failure(exc: BaseException) -> dict:
    """A reply saying why a reading failed."""
    return {"error": type(exc).__name__, "message": str(exc)}


class ReadServer:
    """Answers :class:`Read` requests at ``spec.path`` with the reader ``spec`` builds for
    ``drafter`` (see the module docstring)."""

    def __init__(self, spec: ReaderSpec, drafter: object, device: str = "cpu"):
        self.spec, self.drafter, self.device = spec, drafter, device
        self.sock = private.listen(spec.path, BACKLOG)
        self.reader: Reader | None = None
        self.why = ""
        self._built = threading.Event()
        self._lock = threading.Lock()  # one reading at a time
        self._stream = None
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="d3d-read-accept", daemon=True).start()

    def _build(self) -> None:
        try:
            self.reader = self.spec.build(self.drafter)
            if self.device.startswith("cuda"):
                import torch

                self._stream = torch.cuda.Stream(torch.device(self.device))
        except Exception as exc:  # every request then hears why
            self.why = f"the drafter worker cannot read documents: {type(exc).__name__}: {exc}"
            log.exception("building the document reader failed")
        self._built.set()

    def _accept(self) -> None:
        self._build()
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not private.peer_is_us(conn):
                conn.close()
                continue
            self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        link = Connection(os.dup(conn.fileno()))  # the socket stays ours to shut down
        try:
            while True:
                try:
                    msg = CODEC.decode(link.recv_bytes(MAX_READ))
                except (EOFError, OSError, CodecError):
                    return
                if not isinstance(msg, Read):
                    return
                try:
                    link.send_bytes(CODEC.encode(ReadDone(msg.rid, self.answer(msg.args))))
                except (OSError, CodecError):
                    return
        finally:
            self._open.discard(conn)
            link.close()
            conn.close()

    def answer(self, args: dict) -> dict:
        """The reader's reply to ``args`` (a failure's reply when it raises)."""
        if self.reader is None:
            return failure(RuntimeError(self.why or "the reader is not built"))
        with self._lock:
            try:
                if self._stream is None:
                    return self.reader(args)
                import torch

                with torch.cuda.stream(self._stream):
                    out = self.reader(args)
                self._stream.synchronize()
                return out
            except Exception as exc:
                log.exception("a reading failed")
                return failure(exc)

    def close(self) -> None:
        """Stop listening and end every connection (as the worker's death would)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.spec.path)
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class ReadClient:
    """The service's side of :class:`ReadServer` (see the module docstring); thread-safe."""

    def __init__(self, path: str, timeout: float = 600.0):
        self.path, self.timeout = path, timeout
        self._link: Connection | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def read(self, args: dict) -> dict:
        """The reader's reply to ``args``. ConnectionError: no worker is up to read;
        TimeoutError: it did not answer within ``timeout`` seconds."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    return self._ask(args)
                except (TimeoutError, private.NotPrivateError):
                    self._drop()
                    raise
                except (EOFError, OSError, CodecError) as exc:  # gone, or replaced: once more
                    self._drop()
                    if attempt:
                        raise ConnectionError(
                            "the drafter worker is not up to read the document (it is starting "
                            "or being replaced): retry shortly"
                        ) from exc
        raise AssertionError("unreachable")

    def _ask(self, args: dict) -> dict:
        if self._link is None:
            self._link = self._connect()
        rid = next(self._ids)
        self._link.send_bytes(CODEC.encode(Read(rid, args)))
        if not self._link.poll(self.timeout):
            raise TimeoutError(f"the drafter worker did not finish reading in {self.timeout:.0f} s")
        msg = CODEC.decode(self._link.recv_bytes(MAX_READ))
        if not isinstance(msg, ReadDone) or msg.rid != rid:
            raise CodecError(f"a {type(msg).__name__} is no reply to reading {rid}")
        return msg.result

    def _connect(self) -> Connection:
        if not os.path.exists(self.path):
            raise FileNotFoundError(self.path)
        return Connection(private.connect(self.path).detach())

    def _drop(self) -> None:
        if self._link is not None:
            with contextlib.suppress(OSError):
                self._link.close()
        self._link = None

    def close(self) -> None:
        with self._lock:
            self._drop()
