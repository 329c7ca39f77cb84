"""auto's measured costs survive the process: stored, read back, keyed by configuration."""

import argparse
import json
from dataclasses import asdict

from d3d import cli
from d3d.config import ModelConfig
from d3d.decoding.policy import HostCosts
from d3d.engine.cost_memory import VERSION, costs_path, load_costs, save_costs


def learned() -> HostCosts:
    host = HostCosts()
    host.step_s.add(0.06)
    host.per_token_s.add(0.004)
    host.wait_s.add(0.2)
    host.accept.update(15, 3)
    host.read_s.add(0.002)
    host.answer_len.add(14)
    host.probe_interval, host.since_probe = 256, 40
    host.copy.record(1, 6, 4)
    host.copy.skipped[0] = 5
    return host


def test_costs_round_trip(tmp_path):
    path = tmp_path / "costs" / "x.json"
    host = learned()
    save_costs(host, path)
    back = load_costs(path)
    assert back is not None and asdict(back) == asdict(host)
    assert back.copy.accept[1].accepted[:5] == [1.0] * 4 + [0.0] and back.accept.reached[0] == 1.0


def test_missing_damaged_or_foreign_files_are_a_fresh_start(tmp_path):
    assert load_costs(tmp_path / "none.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert load_costs(bad) is None
    bad.write_text(json.dumps({"version": VERSION, "costs": {"step_s": 3}}))
    assert load_costs(bad) is None
    bad.write_text(json.dumps({"version": VERSION + 1, "costs": asdict(learned())}))
    assert load_costs(bad) is None


def test_the_file_names_the_configuration_not_the_folder(tmp_path):
    a = costs_path(ModelConfig(threads=1), tmp_path)
    assert a == costs_path(ModelConfig(threads=1, costs_dir="/elsewhere"), tmp_path)
    assert a != costs_path(ModelConfig(threads=2), tmp_path)
    assert a != costs_path(ModelConfig(threads=1, target="other/model"), tmp_path)
    assert a != costs_path(ModelConfig(threads=1, pack=False), tmp_path)
    assert a != costs_path(ModelConfig(threads=1, fuse=False), tmp_path)


def test_one_shot_commands_remember_costs_unless_told_not_to(tmp_path, monkeypatch):
    monkeypatch.setenv("D3D_COSTS_DIR", str(tmp_path))
    for remember, extra, want in [
        (True, [], str(tmp_path)),
        (True, ["--fresh-costs"], None),
        (False, [], None),
    ]:
        p = argparse.ArgumentParser()
        cli.add_model_args(p, remember_costs=remember)
        args = p.parse_args(extra)
        assert cli._costs_dir(args) == want
