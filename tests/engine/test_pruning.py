"""Layer pruning on tiny random-weight models: layer removal keeps the rest exact, a full
pruning run writes its table and plot, stops by its criterion and resumes."""

import itertools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen3Config

from d3d.model.drafter import D3DDrafter, DraftSession
from d3d.training.objectives import LossConfig
from d3d.training.prune import PruneConfig, Stage, drop_layers, markdown_table, prune, speedup
from d3d.training.train import TrainConfig

V = 96


@pytest.fixture(params=["llama", "qwen3"])
def target(request):
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True)  # fmt: skip
    cfg = LlamaConfig(**common) if request.param == "llama" else Qwen3Config(head_dim=16, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    return model


def records(n=6):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        base = torch.randint(3, V, (5,), generator=g).tolist()
        out.append({"id": f"r{i}", "prompt_ids": [1, base[0]], "response_ids": (base * 6)[:24]})
    return out


def test_drop_layers_equals_a_drafter_built_from_the_kept_layers(target):
    full = D3DDrafter.from_target(target, [0, 1, 3])
    with torch.no_grad():
        full.mask_embedding.normal_()
    small = drop_layers(full, [0, 2])
    assert small.meta.layers == (0, 3)
    assert len(small.lm.model.layers) == 2
    direct = D3DDrafter.from_target(target, [0, 3])
    with torch.no_grad():
        direct.mask_embedding.copy_(full.mask_embedding)
    ids = [4, 8, 15, 16, 23, 42]
    assert (
        DraftSession(small).draft(ids).tokens.tolist()
        == DraftSession(direct).draft(ids).tokens.tolist()
    )
    c1, c2 = DynamicCache(), DynamicCache()
    small.encode(ids[:-1], c1)
    direct.encode(ids[:-1], c2)
    with torch.no_grad():
        torch.testing.assert_close(
            small.block_logits(ids[-1], c1), direct.block_logits(ids[-1], c2)
        )
    assert small.lm.get_input_embeddings() is target.get_input_embeddings()
    with pytest.raises(ValueError, match="keep"):
        drop_layers(full, [3])


def test_speedup_formula():
    assert speedup(3.0, 50.0, 150.0, 70.0) == pytest.approx(3.0 * 70 / 200)


def test_prune_run_writes_table_plot_and_resumes(target, tmp_path):
    d = D3DDrafter.from_target(target, [0, 1, 2, 3])
    recs = records()
    rec_cfg = TrainConfig(steps=2, lr=1e-3, warmup=1, grad_accum=1, save_every=2,
                          loss=LossConfig(anchors_per_seq=3))  # fmt: skip
    cfg = PruneConfig(min_layers=2, max_stages=2, patience=5, recovery=rec_cfg, val_stride=3,
                      timing_context=16, timing_repeats=2)  # fmt: skip
    stages, chosen = prune(d, target, recs, recs[:2], cfg, tmp_path, progress=False)
    assert [s.layers_kept for s in stages] == [4, 3, 2]
    for prev, s in itertools.pairwise(stages):
        assert s.removed in prev.layers and s.removed not in s.layers
        assert len(s.candidates) == prev.layers_kept
        # the removed layer is the one whose removal hurt acceptance least
        assert s.acceptance_before_recovery == max(s.candidates.values())
    doc = json.loads((tmp_path / "stages.json").read_text())
    best = max(stages, key=lambda s: s.estimated_speedup)
    assert doc["chosen_stage"] == best.stage
    assert tuple(best.layers) == chosen.meta.layers
    assert (tmp_path / "pruning.png").stat().st_size > 0
    assert "(chosen)" in (tmp_path / "stages.md").read_text()
    # A rerun with a larger budget resumes after the last finished stage.
    more = PruneConfig(**{**cfg.__dict__, "max_stages": 3, "min_layers": 1})
    stages2, _ = prune(d, target, recs, recs[:2], more, tmp_path, progress=False)
    assert [s.layers_kept for s in stages2] == [4, 3, 2, 1]
    assert stages2[:3] == stages


def test_prune_stops_when_the_score_stops_improving(target, tmp_path, monkeypatch):
    import d3d.training.prune as pr

    d = D3DDrafter.from_target(target, [0, 1, 2, 3])
    # Acceptance falls fast and timing is flat: removing layers never pays, so stop after one.
    monkeypatch.setattr(pr, "measure", lambda dr, *a: (len(dr.meta.layers) * 1.0, 10.0, 20.0, 10.0))
    cfg = PruneConfig(min_layers=1, max_stages=3, patience=1,
                      recovery=TrainConfig(steps=1, warmup=1, loss=LossConfig(anchors_per_seq=2)))  # fmt: skip
    stages, chosen = prune(d, target, records(), records()[:1], cfg, tmp_path, progress=False)
    assert [s.layers_kept for s in stages] == [4, 3]
    assert len(chosen.meta.layers) == 4
    again, _ = prune(d, target, records(), records()[:1], cfg, tmp_path, progress=False)
    assert again == stages  # a finished run stays finished


def test_markdown_table_marks_choice():
    s = Stage(0, 4, [0, 1, 2, 3], None, 2.5, None, 50.0, 150.0, 70.0, 0.875)
    md = markdown_table([s], 0)
    assert "| 0 **(chosen)** | 4 |" in md and "0.33" in md
