"""The ``drafter-match`` scorer on tiny random Llama / Qwen3 drafters: its states are the
drafter's hidden states after ``depth`` layers, read in windows; a unit holding the question's
tokens ranks first; a document is read once for all its questions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compression.compressor import CompressionConfig, make_scorer
from compression.match_scorer import DrafterMatchScorer
from compression.prompt import PromptParts
from compression.units import Chunk
from d3d.model.drafter import D3DDrafter
from tests.conftest import tiny_model

VOCAB = 101


def drafter(kind: str) -> D3DDrafter:
    target = tiny_model(kind, seed=0, vocab=VOCAB, layers=3, tie=False, window=512)
    return D3DDrafter.from_target(target, 3).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("depth", [1, 2])
def test_states_are_the_hidden_states_after_depth_layers_window_by_window(kind, depth):
    d = drafter(kind)
    ids = torch.randint(2, VOCAB, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    scorer = DrafterMatchScorer(d, depth=depth, window=32)
    got = scorer.states(ids)
    want = []
    with torch.no_grad():
        for a in range(0, 70, 32):
            out = d.lm(input_ids=torch.tensor([ids[a : a + 32]]), output_hidden_states=True)
            want.append(F.normalize(out.hidden_states[depth][0].float(), dim=-1))
    assert got.shape == (70, d.lm.config.hidden_size)
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-5)


def test_the_unit_with_the_questions_tokens_ranks_first_and_a_document_is_read_once():
    d = drafter("llama")
    scorer = DrafterMatchScorer(d, depth=2, window=64)
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(7, 60, (90,), generator=g).tolist()
    question = (61, 62, 63)  # ids the document never uses ...
    ctx[40:43] = question  # ... but for one unit, which holds them all
    units = [Chunk(0, 30), Chunk(30, 60), Chunk(60, 90)]
    parts = PromptParts((1, 2), tuple(ctx), (70, *question), question)
    reads = []
    real = scorer.states
    scorer.states = lambda ids: reads.append(len(ids)) or real(ids)  # type: ignore[method-assign]
    s = scorer.unit_scores(parts, units)
    assert int(s.argmax()) == 1 and s.shape == (3,)
    other = PromptParts((1, 2), tuple(ctx), (70, 9, 10), (9, 10))
    scorer.unit_scores(other, units)  # a second question about the same document
    assert reads == [90, 3, 2], "the document's states come from the first reading"
    with pytest.raises(ValueError, match="depth"):
        DrafterMatchScorer(d, depth=0)
    assert DrafterMatchScorer(d, depth=9).depth == 3  # a shallower drafter: all its layers


def test_a_token_counts_by_how_much_a_unit_beats_its_typical_match():
    """One unit matches a rare question token well; another is a little closer than the rest to
    three tokens every unit is near. The raw cosine would rank the second first (2.6 > 2.4); the
    median contrast ranks the first (0.7 > 0.3), and a unit matching nothing above the typical
    scores 0."""
    scorer = DrafterMatchScorer(drafter("llama"), depth=2)
    cos = torch.tensor(  # [unit, question token]: the match m_t(u)
        [[0.9, 0.5, 0.5, 0.5], [0.2, 0.8, 0.8, 0.8], [0.2, 0.7, 0.7, 0.7], [0.2, 0.7, 0.7, 0.7]]
    )
    scorer._document = lambda parts: cos  # type: ignore[method-assign]  # one token a unit
    scorer.states = lambda ids: torch.eye(4)  # type: ignore[method-assign]
    question = (90, 91, 92, 93)  # ids the document never uses: one idf for all
    parts = PromptParts((), (5, 6, 7, 8), question, question)
    s = scorer.unit_scores(parts, [Chunk(i, i + 1) for i in range(4)])
    idf = torch.tensor(5 / 1).log()
    torch.testing.assert_close(s, idf * torch.tensor([0.7, 0.3, 0.0, 0.0]))


def test_the_registry_builds_it():
    d = drafter("qwen3")
    scorer = make_scorer(CompressionConfig(scorer="drafter-match"), None, d)
    assert isinstance(scorer, DrafterMatchScorer) and scorer.name == "drafter-match"


def test_reading_beside_decoding_leaves_the_other_threads_forward_whole():
    """The hook that ends a reading pass early sits on a layer the target may share: a forward
    of the same model on another thread meanwhile runs to its end."""
    import threading

    d = drafter("llama")
    scorer = DrafterMatchScorer(d, depth=1, window=16)
    ids = torch.arange(2, 40).tolist()
    with torch.no_grad():
        want = d.lm(input_ids=torch.tensor([ids])).logits
    errors: list[BaseException] = []
    got: list[torch.Tensor] = []
    go = threading.Event()

    def other():
        go.wait()
        try:
            with torch.no_grad():
                for _ in range(20):
                    got.append(d.lm(input_ids=torch.tensor([ids])).logits)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    go.set()
    for _ in range(20):
        scorer.states(ids)
    t.join()
    assert not errors and len(got) == 20
    torch.testing.assert_close(got[-1], want)
