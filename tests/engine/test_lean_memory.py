"""Loading allocates what it keeps: no vocabulary-sized tensor built and dropped, logits only for
the rows that need them, and a prefix cache sized from a budget.

A Qwen3-shaped tiny target has Qwen3's real vocabulary (151,936 rows, untied head, hidden 64), so
a full-vocabulary matrix is easy to tell apart from everything else. :class:`FullVocab` watches
every tensor the dispatcher creates (``torch.cuda.memory`` does not exist on a CPU): a fresh
tensor (not a view, not written in place) off the meta device with a V-sized dimension and at
least V x H elements is a full-vocabulary allocation (``min_numel=V``: any tensor over the vocabulary, e.g. logits).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from d3d.backends.sizes import kv_bytes_per_token
from d3d.config import ConfigError, ModelConfig, SamplingConfig
from d3d.engine import DrafterFactory, Engine, build_drafter
from d3d.model.adapters import AdapterConfig
from d3d.model.drafter import D3DDrafter
from d3d.model.load import LoadedModel, load_target, load_target_part
from d3d.model.specs import borrowed_layers
from d3d.worker.drafting import encode_chain
from d3d.worker.protocol import Open
from d3d.worker.server import DraftServer, ServerConfig
from tests.conftest import tiny_model, tiny_tokenizer

V, H = 151_936, 64


class FullVocab(TorchDispatchMode):
    """Records (op, shape, device, dtype) of every full-vocabulary allocation in its scope."""

    def __init__(self, meta: bool = False, min_numel: int = V * H):
        super().__init__()
        self.meta, self.min_numel = meta, min_numel
        self.seen: list[tuple[str, tuple[int, ...], str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor) or (t.is_meta and not self.meta):
                continue
            alias = returns[min(i, len(returns) - 1)].alias_info if returns else None
            if alias is None and V in t.shape and t.numel() >= self.min_numel:
                self.seen.append((str(func), tuple(t.shape), t.device.type, t.dtype))
        return out


def qwen3(dtype=torch.float32, layers=2, seed=0):
    return tiny_model("qwen3", seed=seed, vocab=V, layers=layers).to(dtype)


@pytest.fixture(scope="module")
def target():
    return qwen3(torch.bfloat16, layers=3)


@pytest.mark.parametrize(
    "build",
    [
        lambda t: D3DDrafter.from_target(t, 2),  # layers copied (trained in full)
        lambda t: D3DDrafter.from_target(t, [0, 2], share=True),
        lambda t: D3DDrafter.from_target(t, 3, adapter=AdapterConfig(rank=4)),
        lambda t: build_drafter("self:2", LoadedModel(t, None, "tiny"), share_layers=True),
    ],
    ids=["copy", "share", "adapter", "build_drafter"],
)
def test_building_a_drafter_allocates_no_full_vocab_tensor(target, build):
    with FullVocab() as seen:
        drafter = build(target)
    assert seen.seen == []
    assert drafter.lm.get_output_embeddings() is target.get_output_embeddings()
    assert drafter.mask_embedding.dtype == torch.bfloat16


@pytest.mark.parametrize("adapter", [None, AdapterConfig(rank=4)], ids=["plain", "adapter"])
def test_loading_a_checkpoint_allocates_no_full_vocab_tensor(target, tmp_path, adapter):
    saved = D3DDrafter.from_target(target, [0, 2], adapter=adapter)
    saved.set_draft_vocab(torch.arange(100, 164))
    saved.save(tmp_path / "ckpt")
    with FullVocab() as seen:
        loaded = D3DDrafter.load(tmp_path / "ckpt", target)
    assert seen.seen == []
    ids = [5, 6, 7, 8, 9]
    assert torch.equal(loaded.session().draft(ids).tokens, saved.session().draft(ids).tokens)


def test_placing_elsewhere_copies_embedding_and_head_once_on_the_destination(target):
    drafter = D3DDrafter.from_target(target, 1)
    with FullVocab(meta=True) as seen:
        drafter.place("meta", torch.float16)
    assert sorted(s[2:] for s in seen.seen) == [("meta", torch.float16)] * 2, seen.seen
    tied = tiny_model("llama", vocab=V, tie=True)  # a tied head stays tied: one copy
    drafter = D3DDrafter.from_target(tied, 1)
    with FullVocab(meta=True) as seen:
        drafter.place("meta")
    assert len(seen.seen) == 1
    assert drafter.lm.get_output_embeddings().weight is drafter.lm.get_input_embeddings().weight


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """A 4-layer Qwen3-shaped target saved in bf16 (as Qwen3 checkpoints are)."""
    path = tmp_path_factory.mktemp("qwen3") / "target"
    qwen3(torch.bfloat16, layers=4, seed=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_load_target_reads_weights_straight_into_their_dtype(saved_target, monkeypatch):
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")  # load in this thread, where we watch
    with FullVocab() as seen:
        same = load_target(str(saved_target), dtype="bfloat16")
    assert seen.seen == [], "the stored dtype: views of the mapped file"
    with FullVocab() as seen:
        load_target(str(saved_target), dtype="float32")
    assert len(seen.seen) == 2, "another dtype: embedding and head converted once each"
    assert same.model.dtype == torch.bfloat16


def test_the_drafter_process_reads_only_its_layers_in_the_configured_dtype(saved_target):
    spec = str(saved_target)
    part = load_target_part(spec, lambda _depth: borrowed_layers("self:2", spec))
    layers = part.model.model.layers
    assert [layer.mlp.up_proj.weight.is_meta for layer in layers] == [False, False, True, True]
    assert part.model.dtype == torch.float32 and part.tokenizer is None
    for dtype, allowed in (("bfloat16", 0), ("float32", 2)):
        cfg = ModelConfig(target=spec, drafter="self:2", dtype=dtype, pack=False)
        with FullVocab() as seen:
            drafter = DrafterFactory(cfg)()
        assert len(seen.seen) == allowed, seen.seen  # only the target's embedding and head
        assert drafter.lm.dtype == getattr(torch, dtype)
    whole = load_target(spec, dtype="float32")
    ref = build_drafter("self:2", whole)
    ids = [3, 4, 5, 6, 7, 8]
    assert torch.equal(drafter.session().draft(ids).tokens, ref.session().draft(ids).tokens)


def test_borrowed_layers_follow_the_spec(target, tmp_path):
    assert borrowed_layers("self:3", "tiny") == (0, 1, 2)
    assert borrowed_layers("self:0,5", "tiny") == (0, 5)
    assert borrowed_layers("default", "tiny") == ()  # no trained drafter for it: none read
    D3DDrafter.from_target(target, [0, 2], adapter=AdapterConfig(rank=2)).save(tmp_path / "a")
    D3DDrafter.from_target(target, [0, 2]).save(tmp_path / "p")
    assert borrowed_layers(str(tmp_path / "a"), "tiny") == (0, 2)
    assert borrowed_layers(str(tmp_path / "p"), "tiny") == ()  # its layers are its own


def test_worker_prompt_encoding_scores_the_last_row_only():
    drafter = D3DDrafter.from_target(qwen3(), 1, block_size=4)
    rows = []
    head = drafter.head
    drafter.head = lambda hidden: rows.append(hidden.shape[:-1].numel()) or head(hidden)
    prompt = list(range(10, 50))  # 40 tokens
    server = DraftServer(drafter, ServerConfig(fixed_branches=2))
    with FullVocab(min_numel=V) as seen:
        list(server.handle(Open(1, prompt, SamplingConfig(), 0)))
    assert rows[0] == 1, "the prompt's encoding: the LM head over its last row"
    assert rows[1:] == [2 * 3], "then 2 branches x 3 drafts"
    logits = [s[1] for s in seen.seen if s[1][-1] == V and len(s[1]) > 1]
    assert logits and all(shape[:-1].count(len(prompt)) == 0 for shape in logits), logits


def test_encode_chain_keeps_the_last_rows():
    drafter = D3DDrafter.from_target(tiny_model("qwen3"), 2)
    ids = [3, 8, 13, 21, 34]
    all_rows = encode_chain(drafter, _cache(), ids)
    torch.testing.assert_close(encode_chain(drafter, _cache(), ids, keep=1), all_rows[-1:])
    torch.testing.assert_close(encode_chain(drafter, _cache(), ids, keep=3), all_rows[-3:])


def _cache():
    from transformers import DynamicCache

    return DynamicCache()


def test_the_prefix_cache_is_sized_from_its_budget(monkeypatch):
    model = tiny_model("qwen3")
    target = LoadedModel(model, tiny_tokenizer(), "tiny")
    per_token = kv_bytes_per_token(model.config, torch.float32)
    assert per_token == 2 * 2 * 2 * 16 * 4  # K and V x layers x KV heads x head dim x fp32
    engine = Engine(target, None, ModelConfig(prefix_cache="1000tok"))
    assert engine.prefix_cache.max_bytes == 1000 * per_token
    assert Engine(target, None, ModelConfig(prefix_cache="2GiB")).prefix_cache.max_bytes == 2**31
    monkeypatch.setattr("d3d.model.memory.free_bytes", lambda device: 50 * 2**30)
    assert Engine(target, None, ModelConfig()).prefix_cache.max_bytes == 5 * 2**30
    assert Engine(target, None, ModelConfig(prefix_cache="25%")).prefix_cache.max_bytes == (
        25 * 2**30 // 2
    )
    with pytest.raises(ConfigError, match="prefix_cache"):
        ModelConfig(prefix_cache="lots")
    with pytest.raises(ConfigError, match="prefix_cache"):
        ModelConfig(prefix_cache="120%")


def test_load_target_asks_for_the_device_at_load(saved_target, monkeypatch):
    """On a GPU host the weights must go straight there: transformers gets the device as its
    device map (a CPU load moved afterwards would hold the whole model in host memory first)."""
    from unittest import mock

    import d3d.model.load as models

    calls = []

    def from_pretrained(src, **kwargs):
        calls.append(kwargs)
        return mock.MagicMock()

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    load_target(str(saved_target), device="cuda:1", dtype="bfloat16")
    assert calls[0]["device_map"] == {"": "cuda:1"} and calls[0]["dtype"] == torch.bfloat16
