"""A request's prompt as the engine receives it, and how a route asks for one to be built.

A route never tokenises: it hands the engine worker a :class:`PromptBuilder` (a function of the
worker's models that returns a :class:`Prepared`). Builders that read a document (compression
runs a reader model over it) say so, and run on the worker's reader thread, off the engine
thread, so a long document never holds up the rows that are decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prepared:
    """A job's prompt ids and what building them reports (``info``: compression figures and
    kept spans for a document; ``seconds``: the time it took; ``shared_prefix``: the first
    prompt tokens other requests share, whose KV the engine caches; ``head``: the first prompt
    tokens that every chat with the same system turn starts with, cached like a shared prefix
    where nothing longer is shared)."""

    prompt_ids: list[int]
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    shared_prefix: int = 0
    head: int = 0


@dataclass(frozen=True)
class PromptBuilder:
    """``build(models) -> Prepared``; ``reads_document``: run it on the reader thread."""

    build: Callable[[Any], Prepared]
    reads_document: bool = False

    def __call__(self, models: Any) -> Prepared:
        return self.build(models)
