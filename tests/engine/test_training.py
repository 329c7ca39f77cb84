"""Drafter training on tiny random-weight models: the packed forward matches online drafting,
offline acceptance matches online decoding, a few steps lower the loss, checkpoints round-trip."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from d3d.config import DecodeConfig
from d3d.decoding.proposers import ArProposer, SyncProposer
from d3d.decoding.stats import DecodeStats
from d3d.engine import decode
from d3d.model.drafter import D3DDrafter, DraftSession
from d3d.training.accept import block_predictions, offline_acceptance
from d3d.training.objectives import LossConfig, Packed, block_labels, packed_forward
from d3d.training.train import TrainConfig, train
from tests.conftest import tiny_model

V = 96


def tiny(kind: str = "llama", layers: int = 3):
    return tiny_model(kind, seed=0, vocab=V, layers=layers, tie=True)


@pytest.fixture(params=["llama", "qwen3"])
def target(request):
    return tiny(request.param)


def make_drafter(target, layers=(0, 2), block=8):
    d = D3DDrafter.from_target(target, list(layers), block_size=block)
    with torch.no_grad():
        d.mask_embedding.normal_()
    return d


def test_packed_block_logits_equal_draft_session(target):
    d = make_drafter(target)
    ids = torch.randint(3, V, (30,), generator=torch.Generator().manual_seed(0))
    anchors = [4, 11, 12, 25]
    packed = Packed(ids, anchors, block_labels(ids, anchors, d.block_size), ntp_start=3)
    with torch.no_grad():
        out = packed_forward(d, packed, with_clean=True)
    for i, s in enumerate(anchors):
        # the online path: part of the prefix cached, the rest pending in the drafting forward
        cache = DynamicCache()
        d.encode(ids[: s // 2].tolist(), cache)
        with torch.no_grad():
            online = d.block_logits(int(ids[s]), cache, ids[s // 2 : s].tolist())
        torch.testing.assert_close(out.block[i], online, atol=1e-4, rtol=1e-4)
        greedy = DraftSession(d).draft(ids[: s + 1].tolist()).tokens
        assert out.block[i].argmax(-1).tolist() == greedy.tolist()
    with torch.no_grad():
        causal = d.lm(input_ids=ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(out.clean, causal[3:29], atol=1e-4, rtol=1e-4)


def test_block_predictions_equal_draft_session(target):
    d = make_drafter(target)
    ids = torch.randint(3, V, (40,), generator=torch.Generator().manual_seed(1))
    anchors = list(range(5, 38, 3))
    pred = block_predictions(d, ids, anchors, chunk=4)
    for i, s in enumerate(anchors):
        online = DraftSession(d).draft(ids[: s + 1].tolist()).tokens
        assert pred[i].tolist() == online.tolist()


def greedy_response(model, prompt, n):
    stats = DecodeStats(mode="ar")
    chunks = decode(
        model, ArProposer(), prompt, DecodeConfig(mode="ar", max_new_tokens=n), set(), stats
    )
    return [t for c in chunks for t in c]


def test_offline_rounds_acceptance_equals_online(target):
    d = make_drafter(target)
    prompts = [[5, 9, 17, 3, 44], [8, 8, 2, 61, 70, 11, 12]]
    records, drafts, accepted = [], 0, 0
    for p in prompts:
        resp = greedy_response(target, p, 40)
        records.append({"prompt_ids": p, "response_ids": resp, "source": f"s{len(records)}"})
        cfg = DecodeConfig(mode="sync", max_new_tokens=40, block_size=d.block_size)
        online = DecodeStats(mode="sync")
        out = [t for c in decode(target, SyncProposer(d), p, cfg, set(), online) for t in c]
        assert out == resp
        drafts, accepted = drafts + online.num_drafts, accepted + online.num_accepted_tokens
    off = offline_acceptance(d, records, mode="rounds")
    assert off.acceptance_length > 1.0
    # Online's last round is cut by max_new_tokens; compare over the same rounds.
    assert off.num_rounds == drafts
    assert off.acceptance_length == pytest.approx(1 + accepted / drafts, abs=1e-6)
    groups = off.by_source
    assert sorted(groups) == ["s0", "s1"]
    assert sum(g.num_rounds for g in groups.values()) == off.num_rounds
    weighted = sum(g.acceptance_length * g.num_rounds for g in groups.values()) / off.num_rounds
    assert weighted == pytest.approx(off.acceptance_length, abs=1e-5)
    assert off.to_dict()["by_source"]["s0"]["num_rounds"] == groups["s0"].num_rounds


def synthetic_records(n=6, length=24, seed=0):
    # A repeating pattern the drafter can learn in a few steps.
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, V, (6,), generator=g).tolist()
        resp = (base * 10)[:length]
        out.append({"id": f"r{i}", "prompt_ids": [1, 2, base[0]], "response_ids": resp})
    return out


def test_a_few_steps_lower_the_loss(target, tmp_path):
    with torch.no_grad():  # a random 0.02-scale head makes every logit ~0; give it some range
        target.get_input_embeddings().weight.mul_(20)
    d = make_drafter(target)
    recs = synthetic_records()
    cfg = TrainConfig(steps=20, lr=1e-2, warmup=2, grad_accum=2, save_every=100,
                      loss=LossConfig(gamma=4.0, ntp_weight=0.5, anchors_per_seq=4))  # fmt: skip
    result = train(d, recs, cfg, tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and result.steps == 20
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    assert (tmp_path / "run" / "curve.png").stat().st_size > 1000
    # Shared embeddings and LM head are the target's and stay frozen.
    assert d.lm.get_input_embeddings() is target.get_input_embeddings()
    assert not target.get_input_embeddings().weight.requires_grad


def test_checkpoint_round_trip(target, tmp_path):
    d = make_drafter(target, layers=(1, 2))
    d.save(tmp_path / "ck")
    stored = load_file(str(tmp_path / "ck" / "drafter.safetensors"))
    assert "mask_embedding" in stored
    assert not [k for k in stored if "embed_tokens" in k or "lm_head" in k]  # shared, not stored
    back = D3DDrafter.load(tmp_path / "ck", target)
    ids = [5, 9, 17, 3, 44, 8]
    assert (
        DraftSession(back).draft(ids).tokens.tolist() == DraftSession(d).draft(ids).tokens.tolist()
    )
    assert back.meta.layers == (1, 2)


class Interrupted(Exception):
    pass


def test_resume_continues_to_the_same_weights(target, tmp_path):
    recs = synthetic_records()
    loss = LossConfig(gamma=4.0, ntp_weight=0.5, anchors_per_seq=3)
    cfg = TrainConfig(steps=6, lr=1e-3, warmup=1, grad_accum=1, save_every=3, val_every=3,
                      val_stride=4, loss=loss)  # fmt: skip
    init = make_drafter(target)
    init.save(tmp_path / "init")
    straight = D3DDrafter.load(tmp_path / "init", target)
    train(straight, recs, cfg, tmp_path / "a", progress=False)

    def crash(step, row):
        raise Interrupted

    first = D3DDrafter.load(tmp_path / "init", target)
    with pytest.raises(Interrupted):
        train(first, recs, cfg, tmp_path / "b", recs[:1], progress=False, on_val=crash)
    # A new process rebuilds the drafter from its init and resumes from b/last at step 3.
    resumed = D3DDrafter.load(tmp_path / "init", target)
    result = train(resumed, recs, cfg, tmp_path / "b", progress=False)
    assert result.steps == 6
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [s for s in steps if s] == [1, 2, 3, 3, 4, 5, 6]  # step 3's validation line, then on


def test_read_log_counts_a_repeated_step_once(tmp_path):
    from d3d.training.curves import read_log

    lines = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "val_acceptance_length": 1.2},
             {"step": 2, "loss": 3.5}, {"step": 3, "loss": 3.0}]  # fmt: skip
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows, val = read_log(tmp_path / "log.jsonl")
    assert list(rows) == [1, 2, 3] and rows[2]["loss"] == 3.5
    assert val == {2: 1.2}


def test_train_config_validates():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


class CharTokenizer:
    """Enough of a tokenizer for the engine: ids are character codes modulo the vocabulary."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % (V - 3) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_drafter_eval_report_is_lossless_and_complete(target):
    from d3d.engine import Engine
    from d3d.model.load import LoadedModel
    from d3d.training.evaluate import evaluate

    engine = Engine(LoadedModel(target, CharTokenizer(), "tiny"), make_drafter(target))
    report = evaluate(engine, ["hello there", "abcabcabc"], max_new_tokens=24, progress=False)
    assert report["lossless"] is True and report["n_prompts"] == 2
    assert report["acceptance_length"] >= 1.0
    assert len(report["acceptance_per_position"]) == engine.drafter.block_size - 1
    for key in ("drafter_block_ms", "target_verify_ms", "target_step_ms", "speedup_vs_ar"):
        assert report[key] > 0


def test_init_from_a_whole_pretrained_model(target, tmp_path):
    from d3d.model.drafter import DrafterError
    from d3d.model.load import LoadedModel
    from d3d.training.init import init_drafter
    from d3d.training.train import trainable

    small = tiny(layers=2)
    small.save_pretrained(tmp_path / "small")
    d = init_drafter(f"hf:{tmp_path / 'small'}", LoadedModel(target, None, "tiny"))
    assert not d.meta.shared_embeddings and d.meta.layers == (0, 1)
    assert all(p is not d.lm.get_input_embeddings().weight for p in trainable(d))
    d.save(tmp_path / "ck")
    back = D3DDrafter.load(tmp_path / "ck", target)
    ids = [5, 9, 17, 3]
    assert (
        DraftSession(back).draft(ids).tokens.tolist() == DraftSession(d).draft(ids).tokens.tolist()
    )
    wrong = tiny(layers=1)
    wrong.resize_token_embeddings(V + 8)
    wrong.save_pretrained(tmp_path / "wrong")
    with pytest.raises(DrafterError, match="vocabulary"):
        init_drafter(f"hf:{tmp_path / 'wrong'}", LoadedModel(target, None, "tiny"))


def test_cli_reports_user_errors(tmp_path, capsys):
    from d3d.cli import main

    assert main(["accept", "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "d3d: error: data file not found" in capsys.readouterr().err
    assert main(["drafter-eval", "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert main(["prune", "--data", str(tmp_path / "x.jsonl"), "--out", str(tmp_path)]) == 2
    assert "prune needs --drafter" in capsys.readouterr().err
