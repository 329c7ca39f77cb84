"""The ``drafter-match`` scorer: the question's words found in the document by meaning, in the
drafter's first layers.

A unit scores how much better than the rest of the document it matches the question's tokens in
the drafter's early contextual states (after ``depth`` layers, 2 by default):

    m_t(u) = max_{j in u} cos(h_t, h_j)
    s(u)   = sum_{t in question} idf(t) * max(0, m_t(u) - median_v m_t(v))

``h`` are hidden states (the document's read in windows, the question's on its own); ``idf(t) =
log((N + 1) / (1 + df(t)))`` over the document's N units, so a question token the document
never uses (a paraphrase's word) weighs most, and its nearest states are what find the
paraphrased fact. Two layers in, a token's state already carries its neighbours (a "crimson
journal" sits near a "red notebook") while it is still the token's (deeper, the states drift
towards what comes next and the match fades: on the messy needles, depth 1 / 2 / 3 / 4 / 6 keep
10 / 12 / 9 / 9 / 10 of 12 facts at keep 0.1, with the raw cosine below).

The median is the contrast: a token counts in a unit only by how much it is matched there above
its match in a typical unit, so a question word every unit is about equally close to (the
document's topic, a common word in a new spelling) adds nothing, and a long unit gets no credit
for being loosely near everything. Without it (the raw cosine, clamped at 0) the evidence kept
at keep 0.05 on the recall sets was messy 9 / nq30 20 / offline 14 / LongBench 7 (of 12 / 24 / 16
/ 13), with it 12 / 21 / 13 / 7, and at keep 0.1 LongBench 7 -> 8 (docs/scorers.md).

Reading costs ``depth`` of the drafter's layers over the document, about 2/30 of a target
prefill for the embedded pair (an adapter drafter computes exactly its frozen target layers),
and a document's states serve its next question (the last 8 documents read are kept).

Letters: N document tokens, Q question tokens, H hidden, C units.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from compression.doc_cache import content_key
from compression.prompt import PromptParts
from compression.reading import EarlyExit, windows
from compression.scorers import contrast
from compression.selection import spread
from compression.units import Chunk, fixed_chunks
from d3d.engine.kv_store import BoundedLru
from d3d.model.drafter import D3DDrafter

MEMO_DOCUMENTS = 8  # documents whose states are kept (H x 4 bytes a token; 1 GiB at most)


class DrafterMatchScorer:
    """Question tokens matched by meaning in the drafter's early states (see the module
    docstring)."""

    name = "drafter-match"
    token_level = False

    def __init__(self, drafter: D3DDrafter, depth: int = 2, window: int = 2048):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        # A drafter shallower than ``depth`` is read through all its layers.
        depth = min(depth, len(drafter.lm.model.layers))
        self.model, self.depth, self.window = drafter, depth, window
        self._memo: BoundedLru[torch.Tensor] = BoundedLru(max_entries=MEMO_DOCUMENTS)

    @torch.inference_mode()
    def states(self, ids: Sequence[int]) -> torch.Tensor:
        """Unit-length hidden states after ``depth`` layers, [N, H], read in windows."""
        out = [self._window(list(ids[a:b])) for a, b in windows(len(ids), self.window) if b > a]
        return torch.cat(out) if out else torch.zeros(0, self.model.lm.config.hidden_size)

    def _window(self, ids: list[int]) -> torch.Tensor:
        dev = self.model.device
        x = torch.tensor([ids], device=dev)
        caught: list[torch.Tensor] = []
        me = threading.get_ident()

        def catch(_module, _args, output):
            # The drafter's layers may be the target's own, decoding on another thread meanwhile
            # (the service reads documents beside decoding): only this thread's pass stops here.
            if threading.get_ident() != me:
                return None
            caught.append(output[0] if isinstance(output, tuple) else output)
            raise EarlyExit

        layer = self.model.lm.model.layers[self.depth - 1]
        handle = layer.register_forward_hook(catch)
        try:
            emb = self.model.lm.get_input_embeddings()(x)
            pos = torch.arange(len(ids), device=dev).unsqueeze(0)
            self.model.body(emb, pos, None, None)
        except EarlyExit:
            pass
        finally:
            handle.remove()
        return F.normalize(caught[0][0].float(), dim=-1).cpu()  # [n, H]

    def reading_key(self, parts: PromptParts) -> str:
        return content_key(f"match:{self.depth}:{self.window}", parts.context)

    def has_read(self, parts: PromptParts, units: Sequence[Chunk] = ()) -> bool:
        """Whether this document's states are kept (its next question reads none)."""
        return self.reading_key(parts) in self._memo

    def _document(self, parts: PromptParts) -> torch.Tensor:
        key = self.reading_key(parts)
        states = self._memo.get(key)
        if states is None:
            states = self.states(parts.context)
            self._memo.put_sized(key, states, states.nbytes)
        return states

    def unit_scores(self, parts: PromptParts, units: Sequence[Chunk]) -> torch.Tensor:
        """The score of every unit, [C]."""
        context = list(parts.context)
        question = list(parts.question or parts.suffix)
        if not units or not question:
            return torch.zeros(len(units))
        doc = self._document(parts)  # [N, H]
        q = self.states(question)  # [Q, H]
        seen = Counter(t for c in units for t in set(context[c.start : c.end]))
        n = len(units)
        idf = torch.tensor([math.log((n + 1) / (1 + seen.get(t, 0))) for t in question])
        sims = q @ doc.T  # [Q, N]
        best = torch.stack([sims[:, c.start : c.end].amax(dim=1) for c in units])  # [C, Q]
        return contrast(best, idf)

    def score(self, parts: PromptParts, units: Sequence[Chunk] | None = None) -> torch.Tensor:
        units = units if units is not None else fixed_chunks(len(parts.context), 32)
        return spread(self.unit_scores(parts, units), units)
