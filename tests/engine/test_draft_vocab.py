"""A drafter restricted to a draft vocabulary: exact logits on its tokens, nothing elsewhere,
lossless greedy and sampled decoding, checkpoints, training, resume and pruning keep the ids."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from d3d.config import SamplingConfig
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.model.drafter import IGNORE_LABEL, D3DDrafter, DrafterError, DraftSession
from d3d.training.accept import block_predictions
from d3d.training.data import draft_vocabulary
from d3d.training.objectives import LossConfig, Packed, block_labels, packed_forward
from d3d.training.prune import drop_layers
from d3d.training.train import TrainConfig, train
from tests.conftest import tiny_model
from tests.engine.test_lossless import PROMPTS, run
from tests.engine.test_sampling_exact import (
    V,
    chi2_critical,
    chi_square,
    exact_distribution,
    foreign_drafter,
    sample_many,
)

VOCAB = 96
KEEP = list(range(0, VOCAB, 3))  # every third token


def drafter_of(target, layers=(0, 1), block=8, ids=KEEP):
    d = D3DDrafter.from_target(target, list(layers), block_size=block)
    with torch.no_grad():
        d.mask_embedding.normal_()
    d.set_draft_vocab(ids)
    return d


@pytest.fixture
def target():
    return tiny_model("llama", seed=0, vocab=VOCAB, layers=2, tie=True)


def test_draft_vocabulary_counts_response_tokens():
    recs = [{"response_ids": [5, 5, 7, 9]}, {"response_ids": [7, 5, 11]}]
    assert draft_vocabulary(recs, 2) == [5, 7]
    assert draft_vocabulary(recs, 3) == [5, 7, 9]  # 9 and 11 tie: the smaller id wins
    assert draft_vocabulary(recs, 2, always=[2]) == [2, 5]
    assert draft_vocabulary(recs, 10) == [5, 7, 9, 11]
    with pytest.raises(ValueError, match=">= 1"):
        draft_vocabulary(recs, 0)


def test_restricted_logits_are_the_full_logits_on_the_draft_vocabulary(target):
    d = drafter_of(target)
    full = D3DDrafter.from_target(target, [0, 1], block_size=8)
    with torch.no_grad():
        full.mask_embedding.copy_(d.mask_embedding)
    prefix, anchor = [3, 8, 13, 21, 40], 34
    c1, c2 = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        d.encode(prefix, c1)
        full.encode(prefix, c2)
        restricted, reference = d.block_logits(anchor, c1), full.block_logits(anchor, c2)
    keep = torch.tensor(KEEP)
    torch.testing.assert_close(restricted[:, keep], reference[:, keep], atol=1e-5, rtol=1e-4)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    assert torch.isinf(restricted[:, outside]).all()
    tokens = DraftSession(d).draft([*prefix, anchor]).tokens
    assert tokens.tolist() == keep[reference[:, keep].argmax(-1)].tolist()
    q = d.session(SamplingConfig(temperature=1.0, seed=0)).draft([*prefix, anchor]).q
    assert float(q[:, outside].abs().sum()) == 0.0
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0]))


def test_bad_draft_vocabularies_are_refused(target):
    d = D3DDrafter.from_target(target, 1)
    with pytest.raises(DrafterError, match="lie in"):
        d.set_draft_vocab([0, VOCAB])
    with pytest.raises(DrafterError, match="distinct"):
        d.set_draft_vocab([3, 3])
    d.set_draft_vocab(None)
    assert d.meta.draft_vocab == 0 and d.draft_ids is None


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sync_greedy_with_a_draft_vocabulary_equals_ar(prompt):
    target = tiny_model("llama", seed=0)
    d = D3DDrafter.from_target(target, 1)
    d.set_draft_vocab(list(range(1, target.config.vocab_size, 2)))
    ref, _ = run(target, ArProposer(), prompt)
    out, stats = run(target, SyncProposer(d), prompt)
    assert out == ref and stats.num_tokens == len(ref)


def test_sampling_with_a_draft_vocabulary_matches_the_target_distribution():
    """q is zero on two of the five tokens; the residual must still give them their mass."""
    sampling_kw = {"temperature": 1.0}
    target = tiny_model("llama", seed=3, vocab=V, scale=3.0)
    drafter = foreign_drafter()
    drafter.share_embeddings(target)  # its LM head rows must be the target's
    drafter.set_draft_vocab([0, 2, 4])
    exact = exact_distribution(target, SamplingConfig(**sampling_kw))
    n = 1500
    counts = sample_many(target, "sync", sampling_kw, n, drafter=drafter)
    stat, df = chi_square(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)
    assert any(1 in seq or 3 in seq for seq in counts)  # tokens the drafter cannot propose


def test_checkpoint_stores_the_ids_not_the_head_rows(target, tmp_path):
    d = drafter_of(target)
    d.save(tmp_path / "ck")
    stored = load_file(str(tmp_path / "ck" / "drafter.safetensors"))
    assert stored["draft_ids"].tolist() == KEEP
    assert "draft_head" not in stored
    back = D3DDrafter.load(tmp_path / "ck", target)
    assert back.meta.draft_vocab == len(KEEP)
    ids = [5, 9, 17, 3, 44, 8]
    assert (
        DraftSession(back).draft(ids).tokens.tolist() == DraftSession(d).draft(ids).tokens.tolist()
    )
    torch.testing.assert_close(back.draft_head, target.lm_head.weight[KEEP])


def test_packed_training_forward_and_offline_predictions_match_online(target):
    d = drafter_of(target)
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(0))
    anchors = [4, 11, 25]
    packed = Packed(ids, anchors, block_labels(ids, anchors, d.block_size), ntp_start=3)
    with torch.no_grad():
        out = packed_forward(d, packed, with_clean=True)
    assert out.block.shape[-1] == len(KEEP) and out.clean.shape[-1] == len(KEEP)
    pred = block_predictions(d, ids, anchors)
    for i, s in enumerate(anchors):
        online = DraftSession(d).draft(ids[: s + 1].tolist()).tokens
        assert d.to_target_ids(out.block[i].argmax(-1)).tolist() == online.tolist()
        assert pred[i].tolist() == online.tolist()


def test_labels_outside_the_draft_vocabulary_are_ignored(target):
    d = drafter_of(target)
    labels = torch.tensor([[0, 1, 3, IGNORE_LABEL, 93]])
    assert d.to_draft_labels(labels).tolist() == [[0, IGNORE_LABEL, 1, IGNORE_LABEL, 31]]


def test_training_resume_and_pruning_keep_the_draft_vocabulary(target, tmp_path):
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(20)
    g = torch.Generator().manual_seed(0)
    recs = []
    for i in range(4):
        base = [KEEP[int(j)] for j in torch.randint(1, len(KEEP), (6,), generator=g)]
        recs.append({"id": f"r{i}", "prompt_ids": [1, 2, base[0]], "response_ids": (base * 5)[:24]})
    vocab = draft_vocabulary(recs, 12)
    loss = LossConfig(gamma=4.0, ntp_weight=0.5, anchors_per_seq=4)
    d = drafter_of(target, ids=vocab)
    train(d, recs, TrainConfig(steps=6, lr=1e-2, warmup=2, grad_accum=2, save_every=6, loss=loss),
          tmp_path / "run", progress=False)  # fmt: skip
    # A new process rebuilds the drafter, sets the same vocabulary and resumes from run/last.
    resumed = drafter_of(target, ids=vocab)
    cfg = TrainConfig(steps=12, lr=1e-2, warmup=2, grad_accum=2, save_every=6, loss=loss)
    assert train(resumed, recs, cfg, tmp_path / "run", progress=False).steps == 12
    rows = [json.loads(r) for r in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    back = D3DDrafter.load(tmp_path / "run" / "final", target)
    assert back.draft_ids.tolist() == vocab
    ids = [5, 9, 17, 3, 44, 8]
    assert (
        DraftSession(back).draft(ids).tokens.tolist()
        == DraftSession(resumed).draft(ids).tokens.tolist()
    )
    small = drop_layers(back, [1])
    assert small.draft_ids.tolist() == vocab
    torch.testing.assert_close(small.draft_head, back.draft_head)


def test_train_command_sets_the_vocabulary_and_exports_a_compact_checkpoint(tmp_path, capsys):
    from d3d.cli import main
    from tests.conftest import tiny_tokenizer

    model = tiny_model("llama", seed=0, vocab=VOCAB, layers=2, tie=True)
    model.save_pretrained(tmp_path / "target")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "target")
    data = tmp_path / "data.jsonl"
    rows = [{"id": f"r{i}", "source": "t", "split": "train", "prompt": "p",
             "prompt_ids": [1, 2, 3], "response_ids": [5 + i, 7, 9, 11, 7, 9, 11, 13] * 3}
            for i in range(4)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", "--target", str(tmp_path / "target"), "--drafter", "self:1",
            "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "2",
            "--grad-accum", "1", "--val-seqs", "1", "--max-len", "16", "--anchors", "2",
            "--draft-vocab", "5", "--export", str(tmp_path / "fp16"), "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["export"] == str(tmp_path / "fp16")
    stored = load_file(str(tmp_path / "fp16" / "drafter.safetensors"))
    assert stored["mask_embedding"].dtype == torch.float16
    back = D3DDrafter.load(tmp_path / "fp16", model)
    assert back.meta.draft_vocab == 5
    assert set(back.draft_ids.tolist()) >= {7, 9, 11}  # the most frequent response tokens
    # Rerunning a finished run (e.g. only to --export) runs no step and prints valid JSON.
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["steps"] == 2 and again["loss"] is None
