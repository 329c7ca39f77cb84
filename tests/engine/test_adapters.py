"""Gated-adapter drafters: the target's frozen layers plus LoRA active only at mask slots."""

import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from d3d.model.adapters import AdapterConfig, hide_gated_keys
from d3d.model.drafter import WEIGHTS_FILE, D3DDrafter, DrafterError
from d3d.training.objectives import (
    LossConfig,
    cached_prefix_forward,
    drafter_loss,
    pack,
    packed_forward,
)
from tests.conftest import tiny_model

B = 6


@pytest.fixture(params=["llama", "qwen3"])
def target(request):
    return tiny_model(request.param, seed=3, layers=3, scale=2.0)


def adapter_drafter(target, layers=3, seed=0) -> D3DDrafter:
    """An adapter drafter whose adapters are far from zero, so a leak would show."""
    d = D3DDrafter.from_target(target, layers, block_size=B, adapter=AdapterConfig(rank=4))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        d.mask_embedding.copy_(torch.randn(d.mask_embedding.shape, generator=g))
    return d


def target_cache(model, ids, layers):
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(layers)]


def test_prefix_and_pending_kv_equal_the_targets(target):
    d = adapter_drafter(target, layers=2)
    ids = [4, 9, 13, 2, 7, 30, 31, 8]
    session = d.session()
    session.draft(ids[:5])  # encodes ids[:4]
    session.draft(ids)  # the accepted ids[4:7] ride along with the next block (pending)
    want = target_cache(target, ids[:-1], 2)
    assert session.cache.get_seq_length() == len(ids) - 1
    for i, (k, v) in enumerate(want):
        torch.testing.assert_close(session.cache.layers[i].keys, k)
        torch.testing.assert_close(session.cache.layers[i].values, v)


def test_full_depth_first_draft_is_the_targets_next_token(target):
    d = adapter_drafter(target)
    assert d.exact_prefix
    for ids in ([1, 2, 3], [7, 50, 3, 9, 11, 12], [99]):
        want = int(target(torch.tensor([ids])).logits[0, -1].argmax())
        assert int(d.session().draft(ids).tokens[0]) == want
        scores = d.block_scores(ids[-1], _encoded(d, ids[:-1]))
        torch.testing.assert_close(scores[0], target(torch.tensor([ids])).logits[0, -1])


def _encoded(d, ids):
    cache = DynamicCache()
    d.encode(ids, cache)
    return cache


def test_adapters_act_at_mask_slots():
    target = tiny_model("llama", seed=3, layers=3, scale=2.0)
    d, plain = adapter_drafter(target), D3DDrafter.from_target(target, 3, block_size=B)
    plain.mask_embedding.data.copy_(d.mask_embedding)
    ids = [4, 9, 13, 2]
    assert not torch.allclose(
        d.block_scores(ids[-1], _encoded(d, ids[:-1]))[1:],
        plain.block_scores(ids[-1], _encoded(plain, ids[:-1]))[1:],
    )


def test_three_training_and_drafting_paths_agree(target):
    d = adapter_drafter(target, layers=2)
    g = torch.Generator().manual_seed(0)
    pk = pack(list(range(3, 13)), list(range(20, 40)), 5, B, g)
    fast = cached_prefix_forward(d, pk).block
    packed = packed_forward(d, pk, with_clean=False).block
    ids = pk.ids.tolist()
    online = torch.stack([d.block_scores(ids[s], _encoded(d, ids[:s])) for s in pk.anchors])
    torch.testing.assert_close(fast, packed, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fast, online, atol=1e-5, rtol=1e-4)


def test_layers_share_the_targets_tensors_and_placement_copies(target):
    d = adapter_drafter(target)
    mine, theirs = (
        d.lm.model.layers[1].mlp.up_proj.weight,
        target.model.layers[1].mlp.up_proj.weight,
    )
    assert mine.data_ptr() == theirs.data_ptr() and not mine.requires_grad
    d.place("meta")
    assert theirs.device.type == "cpu" and target.get_input_embeddings().weight.device.type == "cpu"
    assert d.lm.model.layers[1].mlp.up_proj.weight.is_meta


def test_checkpoint_stores_only_trained_tensors_and_round_trips(target, tmp_path):
    d = adapter_drafter(target)
    d.set_draft_vocab(torch.arange(0, 60))
    d.save(tmp_path / "ckpt")
    keys = set(load_file(str(tmp_path / "ckpt" / WEIGHTS_FILE)))
    assert "mask_embedding" in keys and "draft_ids" in keys
    assert all(k.startswith("adapters.") for k in keys - {"mask_embedding", "draft_ids"})
    n_lora = 2 * 3 * 7  # A and B of 7 projections in 3 layers
    assert len(keys) == n_lora + 2
    other = copy.deepcopy(target)  # another process: the same target loaded again
    loaded = D3DDrafter.load(tmp_path / "ckpt", other)
    assert loaded.adapters is not None and loaded.meta.draft_vocab == 60
    ids = [5, 6, 7, 8, 9]
    assert torch.equal(d.session().draft(ids).tokens, loaded.session().draft(ids).tokens)
    q = loaded.lm.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == other.model.layers[0].self_attn.q_proj.weight.data_ptr()


def test_checkpoint_refuses_a_target_of_another_depth(tmp_path):
    adapter_drafter(tiny_model("llama", seed=3, layers=3)).save(tmp_path / "ckpt")
    with pytest.raises(DrafterError, match="3-layer target"):
        D3DDrafter.load(tmp_path / "ckpt", tiny_model("llama", seed=3, layers=4))


def test_deep_copies_and_plain_layer_copies_keep_working(target):
    d = adapter_drafter(target, layers=2)
    ids = [5, 6, 7, 8]
    before = d.block_scores(ids[-1], _encoded(d, ids[:-1]))
    twin = copy.deepcopy(d)  # save_compact copies the drafter: its hooks must follow the copy
    with torch.no_grad():
        for p in d.adapters.parameters():
            p.zero_()
    torch.testing.assert_close(twin.block_scores(ids[-1], _encoded(twin, ids[:-1])), before)
    after = d.block_scores(ids[-1], _encoded(d, ids[:-1]))
    assert not torch.allclose(after[1:], before[1:])
    # Readers of drafter.lm (compression scorers) see ordinary layers: the target's computation.
    sub = D3DDrafter.from_target(twin.lm, 2, block_size=B)
    x = torch.tensor([ids])
    torch.testing.assert_close(
        sub.lm.model(x).last_hidden_state, twin.lm.model(x).last_hidden_state
    )
    assert sub.adapters is None


def test_soft_and_hard_label_training_lowers_the_loss(target):
    d = D3DDrafter.from_target(target, 3, block_size=B, adapter=AdapterConfig(rank=4, alpha=8.0))
    cfg = LossConfig(gamma=3.0, ntp_weight=0.0, anchors_per_seq=6, kl_weight=1.0, topk=4)
    g = torch.Generator().manual_seed(0)
    resp = [10, 11, 12, 13, 14, 15, 16] * 5
    pk = pack([1, 2, 3], resp, 6, B, g)
    params = d.trainable_parameters()
    assert {id(p) for p in params} == {id(d.mask_embedding)} | {
        id(p) for p in d.adapters.parameters()
    }
    for p in params:
        p.requires_grad_(True)
    frozen = d.lm.model.layers[0].self_attn.q_proj.weight.clone()
    opt = torch.optim.Adam(params, lr=5e-3)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        lp = drafter_loss(d, pk, cfg)
        lp.total.backward()
        opt.step()
        losses.append((float(lp.total.detach()), lp.block))
    assert losses[-1][0] < losses[0][0] - 0.5  # hard CE + soft CE (its floor: the entropy)
    assert losses[-1][1] < 0.9 * losses[0][1]
    torch.testing.assert_close(d.lm.model.layers[0].self_attn.q_proj.weight, frozen)


def test_teacher_forced_labels_are_the_targets_argmax(target):
    d = adapter_drafter(target)
    g = torch.Generator().manual_seed(1)
    pk = pack([1, 2, 3], list(range(20, 40)), 4, B, g)
    out = cached_prefix_forward(d, pk, topk=3)
    ids = pk.ids.tolist()
    s = pk.anchors[0]
    for j in range(B - 1):
        if s + j < len(ids):
            want = int(target(torch.tensor([ids[: s + j + 1]])).logits[0, -1].argmax())
            assert int(out.soft[0][0, j, 0]) == want
    teacher_forced = type(pk)(pk.ids, pk.anchors, pk.block_labels, pk.ntp_start, True)
    drafter_loss(d, teacher_forced, LossConfig(ntp_weight=0.0))  # runs with argmax labels
    shallow = adapter_drafter(target, layers=2)
    with pytest.raises(ValueError, match="teacher-forced"):
        drafter_loss(shallow, teacher_forced, LossConfig(ntp_weight=0.0))


def test_hide_gated_keys_bool_float_and_default():
    slots = torch.tensor([False, True, True])
    m = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    out = hide_gated_keys(m, slots, cached=2)
    assert out[0, 0, 0].tolist() == [True, True, True, False, False]
    assert out[0, 0, 1].all() and out[0, 0, 2].all()
    f = hide_gated_keys(torch.zeros(1, 1, 3, 5), slots, cached=2)
    assert torch.equal(f == 0, out)
    causal = hide_gated_keys(None, torch.tensor([False, True, False]), cached=1)
    assert causal[0, 0, 2].tolist() == [True, True, False, True]
    assert hide_gated_keys(None, torch.tensor([True, True]), cached=0) is None


def test_pruning_refuses_an_adapter_drafter(tmp_path):
    from d3d.training.prune import PruneConfig, prune

    target = tiny_model("llama", seed=3, layers=3)
    with pytest.raises(ValueError, match="depth sweep"):
        prune(adapter_drafter(target), target, [], [], PruneConfig(), tmp_path)


def test_two_threads_drafting_with_one_adapter_drafter_get_their_own_gate(target):
    """The engine drafts (sync rows) on its thread while a thread worker drafts with the same
    drafter: each thread's adapters act at its own forward's mask slots."""
    import threading

    d = adapter_drafter(target)
    with torch.no_grad():
        for p in d.adapters.parameters():
            p.normal_(0, 0.5)
    prompts = [list(range(3 + i, 40 + i)) for i in range(6)]
    alone = [d.session().draft(p).tokens.tolist() for p in prompts]
    got: dict[int, list[list[int]]] = {}

    def run(i: int) -> None:
        got[i] = [d.session().draft(prompts[i]).tokens.tolist() for _ in range(5)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, drafts in got.items():
        assert all(x == alone[i] for x in drafts), i
