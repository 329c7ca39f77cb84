"""Prompt compression: score a prompt's context and keep the part that matters.

A prompt is split into prefix (instruction) / context (the document) / suffix (the question);
only the context is cut, into units (:mod:`compression.units`). Scorers (:mod:`compression.scorers`
for the model-free ones and the hybrids, :mod:`compression.question_scorer` for the drafter's
question likelihood, :mod:`compression.match_scorer` for the question matched by meaning in
its first layers, :mod:`compression.drafter_scorers` for its attention) share one interface
and one selection rule (:mod:`compression.selection`), so they differ only in what they rank;
:mod:`compression.presets` holds the measured choices per model pair (``auto``),
:mod:`compression.gaps` marks the cuts in the kept prompt, :mod:`compression.compressor` ties
them together and :mod:`compression.qa` answers questions about documents with the engine.
"""

from compression.compressor import (
    SCORERS,
    Compressed,
    CompressionConfig,
    Compressor,
    make_scorer,
)
from compression.prompt import PromptParts, build_parts

__all__ = [
    "SCORERS",
    "Compressed",
    "CompressionConfig",
    "Compressor",
    "PromptParts",
    "build_parts",
    "make_scorer",
]
