"""The replay's recordings: the target's own greedy output per prompt, from ``ar`` runs.

A recording is keyed by the prompt the drafter reads (a request's ``draft_prompt_ids`` where it
has one, else its prompt) and by its sampling settings less the seed, since penalties and stop
tokens change what greedy decoding says. A longer recording of the same key replaces a shorter
one (both are prefixes of the same greedy text). The engine fills the book as it runs ``ar``
requests (:meth:`d3d.replay.ReplayDrafter.for_request`); only plain greedy requests count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from d3d.config import SamplingConfig

Key = tuple[tuple[int, ...], SamplingConfig]


def book_key(prompt: Sequence[int], sampling: SamplingConfig) -> Key:
    return tuple(int(t) for t in prompt), replace(sampling, seed=None)


class ReplayBook:
    """Recorded greedy outputs (see the module docstring)."""

    def __init__(self) -> None:
        self._out: dict[Key, list[int]] = {}

    def __len__(self) -> int:
        return len(self._out)

    def record(
        self, prompt: Sequence[int], sampling: SamplingConfig, output: Sequence[int]
    ) -> None:
        """Keep ``output`` as the greedy text after ``prompt`` (unless a longer one is kept)."""
        if not sampling.greedy or not output:
            return
        key = book_key(prompt, sampling)
        if len(output) > len(self._out.get(key, ())):
            self._out[key] = [int(t) for t in output]

    def get(self, prompt: Sequence[int], sampling: SamplingConfig) -> list[int] | None:
        """The recorded output after ``prompt`` (None: no recording)."""
        return self._out.get(book_key(prompt, sampling))

    def find(
        self, token_ids: Sequence[int], sampling: SamplingConfig
    ) -> tuple[list[int], list[int]] | None:
        """(prompt, output) of the recording whose prompt ``token_ids`` (a prompt and what was
        generated after it so far) starts with: one that the generated text follows first, then
        the longest prompt; None when no recorded prompt starts it."""
        ids = [int(t) for t in token_ids]
        want = replace(sampling, seed=None)
        best, rank = None, (False, -1)
        for (prompt, s), out in self._out.items():
            p = len(prompt)
            if s != want or p > len(ids) or tuple(ids[:p]) != prompt:
                continue
            mine = (ids[p:] == out[: len(ids) - p], p)
            if mine > rank:
                best, rank = (list(prompt), out), mine
        return best
