"""Shared fixtures: tiny random-weight models (milliseconds to build) and drafter test doubles.

The doubles implement the engine's ``Drafter`` protocol: an *oracle* that drafts exactly what
greedy decoding of the target would produce, and an *always-wrong* one that drafts a different
token at every position. They let the exactness tests reach both extremes of acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen3Config

from d3d.drafter import Draft

TINY_VOCAB = 101

# Tiny models run fastest on one thread, and CI's two cores are shared with the test process.
torch.set_num_threads(1)


def tiny_config(
    kind: str, vocab: int = TINY_VOCAB, layers: int = 2, tie: bool | None = None, window: int = 512
):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True if tie is None else tie)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=bool(tie))
    raise ValueError(kind)


def tiny_model(
    kind: str,
    seed: int = 0,
    vocab: int = TINY_VOCAB,
    layers: int = 2,
    scale: float = 1.0,
    tie: bool | None = None,
    window: int = 512,
):
    """A random-weight causal LM; ``scale`` multiplies the weights to sharpen its distributions."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(kind, vocab, layers, tie, window), attn_implementation="sdpa"
    )
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(scale)
    model.eval().requires_grad_(False)
    return model


def tiny_tokenizer(vocab: int = TINY_VOCAB):
    """A word-level tokenizer over ``vocab`` made-up words ``w0 .. w{vocab-1}`` (offline, instant)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="w0",
        bos_token="w0",
        eos_token=f"w{vocab - 1}",
        pad_token="w0",
    )


@pytest.fixture(params=["llama", "qwen3"])
def tiny_target(request) -> PreTrainedModel:
    return tiny_model(request.param, seed=1)


def greedy_continuation(model: PreTrainedModel, ids: Sequence[int], n: int) -> list[int]:
    """n greedy tokens after ids, recomputed from scratch (slow, obviously right)."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids) :]


class _OracleSession:
    def __init__(self, target: PreTrainedModel, k: int, wrong: bool):
        self.target, self.k, self.wrong = target, k, wrong

    def draft(self, token_ids: Sequence[int]) -> Draft:
        toks = torch.tensor(greedy_continuation(self.target, token_ids, self.k))
        if self.wrong:
            toks = (toks + 1) % self.target.config.vocab_size
        return Draft(tokens=toks, q=None)


class OracleDrafter:
    """Drafts the target's own greedy continuation (``wrong=True``: a different token each slot)."""

    def __init__(self, target: PreTrainedModel, block_size: int = 16, wrong: bool = False):
        self.target, self.k, self.wrong = target, block_size - 1, wrong

    @property
    def block_size(self) -> int:
        return self.k + 1

    def session(self, sampling, generator) -> _OracleSession:
        return _OracleSession(self.target, self.k, self.wrong)


def tiny_engine(model: PreTrainedModel, drafter=None, block_size: int | None = None):
    """The library's :class:`~d3d.engine.Engine` over a tiny model and a made-up tokenizer
    (``block_size``: the copy rounds' block when there is no drafter)."""
    from d3d.engine import Engine
    from d3d.models import LoadedModel

    engine = Engine(LoadedModel(model, tiny_tokenizer(model.config.vocab_size), "tiny"), drafter)
    if block_size is not None:
        engine.default_block = block_size
    return engine
