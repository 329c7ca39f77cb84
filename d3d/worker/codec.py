"""The bytes of the drafter worker's messages: msgpack, tagged by message type, never pickle.

A message crossing the worker's socket pair (:mod:`d3d.worker.workers`) is one msgpack object
framed by :class:`multiprocessing.connection.Connection`'s ``send_bytes`` / ``recv_bytes``
(a length prefix; no pickle is ever read). Three extension types carry what msgpack has no
word for:

- ``DATACLASS``: ``[name, {field: value}]``, a message of :data:`~d3d.worker.protocol.MESSAGES`
  by its class name (and the :class:`~d3d.config.SamplingConfig` inside an ``Open``); decoding
  builds only those classes, with only their own fields;
- ``ARRAY``: ``[dtype, shape, bytes]``, a numeric numpy array (a block's q tables);
- ``TUPLE``: a tuple (so that frozen dataclasses get back the tuples they were built with).

Anything else (an unknown tag, a field the class does not have, an object array, a pickle)
raises :class:`CodecError` (a ``ValueError``): the reader treats the sender as broken.

The worker process's first message, :class:`~d3d.worker.workers.ChildStart`, says how to build
the drafter: a factory, which is code. It is the parent's instruction to a child it started (the
parent chose the child's command line and environment already), and it is decoded with
``start=True`` only, by the child only, once: there ``FACTORY`` names a frozen dataclass by its
module and qualified name, imported from the project's own packages (:data:`FACTORY_PACKAGES`)
and built from its fields; any other class is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable

import msgpack
import numpy as np

DATACLASS, ARRAY, TUPLE, FACTORY = 1, 2, 3, 4
NUMERIC = "biuf"  # numpy kinds an array may have: bool, int, uint, float
FACTORY_PACKAGES = ("d3d", "app", "compression", "eval", "tests")


class CodecError(ValueError):
    """Bytes that are no message of the protocol."""


class Codec:
    """Encode and decode the messages of ``classes`` (see the module docstring)."""

    def __init__(self, classes: Iterable[type]):
        self.classes: dict[str, type] = {}
        for cls in classes:
            self.register(cls)

    def register(self, cls: type) -> type:
        """Add a message class (a module that extends the protocol, such as the replay
        instrument's ``ReplayOpen``, registers it where it is defined: the worker process
        imports that module before such a message can reach it). Usable as a decorator."""
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        if self.classes.setdefault(cls.__name__, cls) is not cls:
            raise TypeError(f"two message classes named {cls.__name__}")
        return cls

    # ----- encoding ---------------------------------------------------------------------
    def encode(self, msg: object, start: bool = False) -> bytes:
        """The bytes of ``msg``; ``start``: dataclasses outside the protocol go by import name
        (the worker's start message)."""
        return msgpack.packb(msg, default=lambda o: self._ext(o, start), strict_types=True)

    def _ext(self, obj: object, start: bool) -> msgpack.ExtType:
        pack = lambda value: msgpack.packb(  # noqa: E731
            value, default=lambda o: self._ext(o, start), strict_types=True
        )
        if isinstance(obj, tuple):
            return msgpack.ExtType(TUPLE, pack(list(obj)))
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in NUMERIC:
                raise CodecError(f"an array of {obj.dtype} cannot cross")
            data = np.ascontiguousarray(obj)
            return msgpack.ExtType(ARRAY, pack([data.dtype.str, list(data.shape), data.tobytes()]))
        if isinstance(obj, np.generic):
            return obj.item()
        for base in (bool, int, float, str, bytes, list, dict):  # subclasses: IntEnum, ...
            if isinstance(obj, base):
                return base(obj)  # type: ignore[call-arg]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            cls = type(obj)
            if self.classes.get(cls.__name__) is cls:
                return msgpack.ExtType(DATACLASS, pack([cls.__name__, fields]))
            if start:
                return msgpack.ExtType(FACTORY, pack([import_name(cls), fields]))
        raise CodecError(f"a {type(obj).__name__} is no message of the protocol")

    # ----- decoding ---------------------------------------------------------------------
    def decode(self, data: bytes, start: bool = False) -> object:
        """The message in ``data``; CodecError for anything else (see the module docstring)."""
        try:
            msg = msgpack.unpackb(
                data, ext_hook=lambda code, raw: self._from_ext(code, raw, start), raw=False
            )
        except CodecError:
            raise
        except Exception as exc:  # msgpack's own errors, truncated or trailing bytes
            raise CodecError(f"unreadable message ({type(exc).__name__}: {exc})") from None
        if not dataclasses.is_dataclass(msg):
            raise CodecError(f"a {type(msg).__name__} is no message of the protocol")
        return msg

    def _from_ext(self, code: int, raw: bytes, start: bool) -> object:
        value = msgpack.unpackb(raw, ext_hook=lambda c, r: self._from_ext(c, r, start), raw=False)
        if code == TUPLE:
            return tuple(value)
        if code == ARRAY:
            dtype, shape, buf = value
            dt = np.dtype(str(dtype))
            if dt.kind not in NUMERIC:
                raise CodecError(f"an array of {dt} cannot cross")
            return np.frombuffer(buf, dtype=dt).reshape([int(n) for n in shape]).copy()
        if code == DATACLASS:
            name, fields = value
            cls = self.classes.get(name)
            if cls is None:
                raise CodecError(f"unknown message {name!r}")
            return _build(cls, fields)
        if code == FACTORY and start:
            name, fields = value
            return _build(import_factory(str(name)), fields)
        raise CodecError(f"unknown extension type {code}")


def _build(cls: type, fields: object) -> object:
    if not isinstance(fields, dict):
        raise CodecError(f"{cls.__name__}: fields must be a map")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(fields) - known
    if unknown:
        raise CodecError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"{cls.__name__}: {exc}") from None


def import_name(cls: type) -> str:
    """``module:qualname``: how a class is named across processes."""
    return f"{cls.__module__}:{cls.__qualname__}"


def import_factory(name: str) -> type:
    """A frozen dataclass of the project's packages, by ``module:qualname``; nothing else."""
    module, _, qualname = name.partition(":")
    if module.split(".")[0] not in FACTORY_PACKAGES or not qualname:
        raise CodecError(f"{name!r} is not a class of this project")
    try:
        obj: object = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise CodecError(f"{name!r}: {exc}") from None
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise CodecError(f"{name!r} is not a dataclass")
    if not obj.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise CodecError(f"{name!r} is not a frozen dataclass")
    return obj
