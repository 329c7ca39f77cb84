"""``d3d plan`` at Qwen3-8B and Qwen3-32B shapes against a meta-device measurement.

The measurement is independent of the planner's arithmetic: the models are built on the meta
device by transformers (and the drafter by :meth:`D3DDrafter.from_target`, the code the engine
runs), and their parameters' numel x element size are summed; KV bytes a token are
2 x layers x KV heads x head dim x element size from the published hyperparameters.
"""

import argparse
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from d3d.backends.cuda.drafter import KV_TOKENS
from d3d.model.drafter import D3DDrafter
from d3d.model.shapes import CONFIGS
from d3d.tools.plan import PlanError, PlanSettings, make_plan, register

# name: hidden, layers, heads, KV heads, head dim, intermediate, vocab, published parameters
PUBLISHED = {
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, 8.19e9),
    "qwen3-32b": (5120, 64, 64, 8, 128, 25600, 151936, 32.8e9),
}


def run_plan(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv, "--json"])
    from contextlib import redirect_stdout
    from io import StringIO

    out = StringIO()
    with redirect_stdout(out):
        assert args.func(args) == 0
    return json.loads(out.getvalue())


def meta_model(name: str) -> torch.nn.Module:
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def measured(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_hold_the_published_shapes(name):
    hidden, layers, heads, kv, hd, inter, vocab, _ = PUBLISHED[name]
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    got = (d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"])
    assert got == (hidden, layers, heads)
    assert (d["num_key_value_heads"], d["head_dim"], d["intermediate_size"]) == (kv, hd, inter)
    assert d["vocab_size"] == vocab and d["tie_word_embeddings"] is False


@pytest.mark.parametrize(("name", "n"), [("qwen3-8b", 31), ("qwen3-32b", 5)])
def test_plan_matches_the_meta_measurement(name, n):
    hidden, layers, _, kv, hd, inter, vocab, published = PUBLISHED[name]
    plan = run_plan(
        "--target", name, "--drafter", f"self:{n}", "--dtype", "bfloat16", "--batch", "4",
        "--max-kv-tokens", "8192", "--device", "cuda:0", "--drafter-device", "cuda:1",
    )  # fmt: skip
    target = meta_model(name)
    t, d = plan["target"], plan["drafter"]
    assert t["weight_bytes"] == pytest.approx(measured(target), rel=0.05)
    assert t["parameters"] == pytest.approx(published, rel=0.01)
    assert t["kv_bytes_per_token"] == 2 * layers * kv * hd * 2
    assert t["kv_bytes"] == t["kv_bytes_per_token"] * 8192 * 4
    drafter = D3DDrafter.from_target(target, n, device="meta")  # on its own device: a copy
    assert d["weight_bytes"] == pytest.approx(measured(drafter), rel=0.05)
    assert d["kv_bytes_per_token"] == 2 * n * kv * hd * 2
    devices = plan["devices"]
    assert devices["cuda:0"]["peak_bytes"] == sum(t[k] for k in ("weight_bytes", "kv_bytes",
                                                                 "workspace_bytes"))  # fmt: skip
    assert set(devices) == {"cuda:0", "cuda:1"}
    # The branch workspace: 8 branches x (B-1) slots of logits (+ float32 probabilities) dominate.
    branch = d["notes"]["branch_workspace_bytes"]
    assert branch >= 8 * 15 * vocab * (2 + 4) + 9 * 16 * (2 * hidden + 3 * inter) * 2


def test_a_drafter_on_the_targets_device_shares_its_layers():
    plan = run_plan("--target", "qwen3-8b", "--drafter", "self:31", "--max-kv-tokens", "1024")
    assert plan["drafter"]["weight_bytes"] == 4096 * 2  # its mask embedding only
    assert list(plan["devices"]) == ["cuda:0"]


def test_a_separate_drafter_model_counts_its_own_weights():
    plan = run_plan(
        "--target", "qwen3-32b", "--drafter", str(CONFIGS / "qwen3-8b.json"),
        "--drafter-device", "cuda:1", "--batch", "16", "--max-kv-tokens", "32768",
    )  # fmt: skip
    assert plan["drafter"]["weight_bytes"] == pytest.approx(
        measured(meta_model("qwen3-8b")), rel=0.05
    )
    assert plan["devices"]["cuda:0"]["kv_bytes"] == 2 * 64 * 8 * 128 * 2 * 32768 * 16


def test_cpu_dtype_auto_plans_float32():
    s = PlanSettings(target="qwen3-8b", dtype="auto", device="cpu", drafter="self:2")
    plan = make_plan(s)
    assert plan.target.dtype == "float32"
    assert plan.target.weight_bytes == pytest.approx(2 * measured(meta_model("qwen3-8b")), 0.01)
    assert "| **peak** | cpu |" in plan.table()


def test_bad_inputs_fail_with_one_line(tmp_path):
    with pytest.raises(PlanError, match="no model config"):
        make_plan(PlanSettings(target=str(tmp_path / "none")))
    with pytest.raises(PlanError, match="layers must lie"):
        make_plan(PlanSettings(target="qwen3-8b", drafter="self:40"))
    other = tmp_path / "small.json"
    d = json.loads((CONFIGS / "qwen3-8b.json").read_text())
    other.write_text(json.dumps({**d, "vocab_size": 1000}))
    with pytest.raises(PlanError, match="vocabulary"):
        make_plan(PlanSettings(target="qwen3-8b", drafter=str(other)))
    with pytest.raises(PlanError, match="batch"):
        PlanSettings(target="qwen3-8b", batch=0)


def test_plan_is_a_registered_command():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    group = text.split('[project.entry-points."d3d.commands"]')[1].split("\n[")[0]
    assert 'plan = "d3d.tools.plan:register"' in group


def test_beside_vllm_every_process_is_counted_and_the_drafter_shares_nothing():
    """Three processes: the API with no model, vLLM's engine core with the target, the drafter
    worker with its own copy of the layers (never the target's tensors, even on one device),
    its slot KV pool and a /qa reading beside its branches."""
    own = run_plan("--target", "qwen3-8b", "--drafter", "self:4", "--max-kv-tokens", "1024")
    plan = run_plan(
        "--target", "qwen3-8b", "--drafter", "self:4", "--max-kv-tokens", "1024",
        "--engine", "vllm", "--document-tokens", "2000",
    )  # fmt: skip
    d, t = plan["drafter"], plan["target"]
    assert own["drafter"]["weight_bytes"] == 4096 * 2  # the own engine shares the layers
    layers = D3DDrafter.from_target(meta_model("qwen3-8b"), 4, device="meta")
    assert d["weight_bytes"] == pytest.approx(measured(layers), rel=0.05)
    assert d["kv_bytes"] == d["kv_bytes_per_token"] * KV_TOKENS  # allocated at start on a GPU
    reading = d["notes"]["reading_workspace_bytes"]
    assert reading > 0 and d["workspace_bytes"] >= d["notes"]["branch_workspace_bytes"] + reading
    procs = {p["process"]: p for p in plan["processes"]}
    assert set(procs) == {"d3d serve (API)", "vLLM engine core", "drafter worker"}
    assert procs["d3d serve (API)"]["bytes"] == 0
    total = lambda part: part["weight_bytes"] + part["kv_bytes"] + part["workspace_bytes"]  # noqa: E731
    assert procs["vLLM engine core"]["bytes"] == total(t)
    assert procs["drafter worker"]["bytes"] == total(d)
    assert plan["devices"]["cuda:0"]["peak_bytes"] == total(t) + total(d)
    with pytest.raises(PlanError, match="engine"):
        PlanSettings(target="qwen3-8b", engine="tgi")
