"""The replay instrument through the engine: lossless in ``sync`` and ``async``, alone and in a
batch of mixed modes, acceptance near TAU, branch hits near HIT, clear errors for what it cannot
replay, a drafter shape's real forwards, a worker in its own process, and ``d3d generate``."""

from __future__ import annotations

import json
import logging

import pytest

from d3d.backends.cuda import CudaBackend
from d3d.config import DecodeConfig, ModelConfig, SamplingConfig
from d3d.engine import GenRequest, build_drafter
from d3d.model.load import LoadedModel
from d3d.model.meta import DrafterError
from d3d.replay import ReplayDrafter
from d3d.replay.server import ReplayOpen
from d3d.replay.shape import PackedShapeForwards, ShapeForwards
from d3d.worker.protocol import Block, Commit, Commits, Failed
from d3d.worker.server import ServerConfig
from tests.conftest import tiny_engine, tiny_model, tiny_tokenizer

PROMPT = [1, 5, 9, 22, 7]


def replay_engine(model, spec: str = "replay:7.88"):
    engine = tiny_engine(model, build_drafter(spec, LoadedModel(model, None, "tiny")))
    engine.scheduler(max_batch=16).eos_ids = set()  # random weights: run to the budget
    return engine


@pytest.fixture
def engine(tiny_target):
    eng = replay_engine(tiny_target)
    yield eng
    eng.close()


def gen(engine, mode: str, n: int, prompt=PROMPT, **sampling):
    cfg = DecodeConfig(mode=mode, max_new_tokens=n, sampling=SamplingConfig(**sampling))
    return engine.generate_ids(prompt, cfg)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_replay_equals_ar_and_lands_near_tau(engine, mode):
    ref = gen(engine, "ar", 420)
    out = gen(engine, mode, 420)
    assert out.token_ids == ref.token_ids
    st = out.stats
    assert st.drafter == "replay:7.88:0.78 (measurement instrument)"
    assert out.to_dict()["drafter"] == st.drafter and "drafter" not in ref.to_dict()
    # 54 rounds; the last one is cut short by the end of the recording
    assert abs(st.acceptance_length - 7.88) < 0.25, st.acceptance_length
    per = st.accepted_per_position
    assert st.worker_failures == 0 and per[0] > per[7] > 0  # rounds vary around the mean
    if mode == "async":
        assert st.branch_hits + st.branch_misses == st.num_drafts
        assert abs(st.hit_rate - 0.78) < 0.06, st.hit_rate
        assert st.branches_per_round == 16  # no shape: max_branches a round
    again = gen(engine, mode, 420)  # the same prompt replays the same rounds
    assert again.stats.accepted_per_position == st.accepted_per_position


@pytest.mark.parametrize(("spec", "tau"), [("replay:1:0", 1.0), ("replay:16:1", 16.0)])
def test_the_extremes(tiny_target, spec, tau):
    engine = replay_engine(tiny_target, spec)
    try:
        ref = gen(engine, "ar", 161)  # the prefill's token + 10 rounds of 16
        out = gen(engine, "async", 161)
        assert out.token_ids == ref.token_ids
        assert out.stats.acceptance_length == tau and out.stats.num_drafts > 0
        assert out.stats.hit_rate == (tau == 16.0)
    finally:
        engine.close()


@pytest.mark.parametrize("rows", [1, 16])
def test_a_batch_of_mixed_modes_joining_mid_flight_equals_ar(engine, rows):
    prompts = [[(7 * i + j) % 90 + 2 for j in range(3 + (11 * i) % 37)] for i in range(rows)]
    budgets = [30 + (13 * i) % 50 for i in range(rows)]
    refs = [engine.record([p], n)[0] for p, n in zip(prompts, budgets, strict=True)]
    sched = engine.scheduler()
    modes = ["sync", "async", "ar"]
    out: list[list[int]] = [[] for _ in prompts]
    stats: list = [None] * rows

    def done(i: int):
        def finish(st, err):
            assert err is None, err
            stats[i] = st

        return finish

    for i in range(rows):
        req = GenRequest(prompts[i], budgets[i], mode=modes[i % 3], on_tokens=out[i].extend)
        req.on_finish = done(i)
        sched.add(req)
        if i >= rows // 2:  # the second half joins one per step
            sched.step()
    while not sched.idle:
        sched.step()
    assert out == refs
    for i, st in enumerate(stats):
        if modes[i % 3] != "ar":
            assert st.drafter and st.num_drafts > 0 and st.acceptance_length > 3.0
        if modes[i % 3] == "async":
            assert st.branch_hits + st.branch_misses == st.num_drafts


def test_hit_rate_follows_hit(tiny_target):
    engine = replay_engine(tiny_target, "replay:4:0.5")
    try:
        gen(engine, "ar", 400)
        st = gen(engine, "async", 400).stats
        assert abs(st.hit_rate - 0.5) < 0.06 and abs(st.acceptance_length - 4.0) < 0.2
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_no_recording_is_a_clear_error(engine, mode):
    with pytest.raises(DrafterError, match=r"no recording .* mode ar first"):
        gen(engine, mode, 10)
    gen(engine, "ar", 10)
    assert len(gen(engine, mode, 10).token_ids) == 10


def test_what_it_cannot_replay_is_refused(engine):
    gen(engine, "ar", 10)
    with pytest.raises(DrafterError, match="greedy"):
        gen(engine, "sync", 10, temperature=1.0, seed=1)
    with pytest.raises(DrafterError, match="sync and async"):
        gen(engine, "auto", 10)


def test_past_the_recording_or_off_it_the_target_goes_on_alone(engine, caplog):
    caplog.set_level(logging.INFO, logger="d3d.replay")  # the end of a recording: info only
    ref = gen(engine, "ar", 60).token_ids
    engine.drafter.book.record(PROMPT, SamplingConfig(), ref[:20])  # kept: the longer wins
    other = [2, 3, 4]
    wrong = [(t + 1) % 100 for t in gen(engine, "ar", 40, prompt=other).token_ids]
    engine.drafter.book._out.clear()
    engine.drafter.book.record(PROMPT, SamplingConfig(), ref[:20])
    engine.drafter.book.record(other, SamplingConfig(), wrong)
    for mode in ("sync", "async"):
        short = gen(engine, mode, 60)
        assert short.token_ids == ref and short.stats.ar_tokens > 30  # plain steps past 20
        off = gen(engine, mode, 40, prompt=other)
        assert off.stats.num_drafts <= 1 and len(off.token_ids) == 40
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("left the recording" in m for m in warned)
    assert "recording ends" in caplog.text and not any("recording ends" in m for m in warned)


def test_a_shape_runs_real_forwards(tiny_target, tmp_path, monkeypatch):
    calls = {"blocks": 0, "branches": 0}
    for name in calls:
        real = getattr(ShapeForwards, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(ShapeForwards, name, counted)
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 16}
        )
    )  # fmt: skip
    for spec in ("replay:5:0.5:self:1", f"replay:5:0.5:shape={config}@2"):
        engine = replay_engine(tiny_target, spec)
        try:
            assert isinstance(engine.drafter, ReplayDrafter) and engine.drafter.shape is not None
            ref = gen(engine, "ar", 80)
            for mode in ("sync", "async"):
                assert gen(engine, mode, 80).token_ids == ref.token_ids
        finally:
            engine.close()
    assert calls["blocks"] > 0 and calls["branches"] > 0
    assert len(engine.drafter.shape.lm.model.layers) == 2


def test_a_shape_the_cuda_backend_readied_drafts_packed(tiny_target, packed_rows):
    """On the cuda backend the shape's forwards are the packed drafter's (what the D3D worker
    runs there, its steps rehearsed as graphs, d3d.backends.cuda.rehearsal): a step's misses
    in one forward, every row's branches in one more; ``sync`` drafts on the worker too.
    Lossless, acceptance and hits as without, and no draft failed."""
    drafter = build_drafter("replay:5:0.5:self:1", LoadedModel(tiny_target, None, "tiny"))
    backend = CudaBackend(graphs=True)
    backend.prepare_drafter(drafter.lm)
    engine = tiny_engine(tiny_target, drafter, backend=backend)
    sched = engine.scheduler(max_batch=8)
    sched.eos_ids = set()
    prompts = [[1 + i, 5, 9, 22 + i, 7] for i in range(4)]
    try:
        ref = engine.record(prompts, 60)
        for mode in ("sync", "async"):
            out: list[list[int]] = [[] for _ in prompts]
            stats = []
            for p, o in zip(prompts, out, strict=True):
                sched.add(GenRequest(p, 60, mode=mode, on_tokens=o.extend,
                                     on_finish=lambda st, err, got=stats: got.append((st, err))))  # fmt: skip
            while not sched.idle:
                sched.step()
            assert out == ref, mode
            assert all(err is None and st.worker_failures == 0 for st, err in stats), mode
            assert 4.0 <= sum(st.acceptance_length for st, _ in stats) / 4 <= 6.0, mode
            if mode == "async":
                assert sum(st.branch_hits for st, _ in stats) > 0
    finally:
        engine.close()
    assert max(packed_rows) == 4  # the four rows in one forward


def test_a_worker_in_its_own_process_and_d3d_generate(tmp_path, capsys):
    from d3d.cli import main
    from d3d.engine import Engine
    from d3d.worker.workers import available_cores

    model = tiny_model("llama", seed=1)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    target = str(tmp_path / "m")
    args = ["generate", "w1 w5 w9", "--target", target, "--drafter", "replay:6:0.5",
            "--no-chat-template", "--max-new-tokens", "40", "--json", "--fresh-costs"]  # fmt: skip
    assert main([*args, "--mode", "sync"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafter"] == "replay:6:0.5 (measurement instrument)" == out["sync"]["drafter"]
    assert out["identical"] and out["sync"]["num_drafts"] > 0 and "speedup" in out
    assert main([*args, "--mode", "auto"]) == 2
    assert "sync or async" in capsys.readouterr().err
    assert main(["bench", "--target", target, "--drafter", "replay:6"]) == 2
    assert "measurement instrument" in capsys.readouterr().err
    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs two cores")
    cfg = ModelConfig(
        target=target, drafter="replay:6:0.5:self:1", drafter_device=f"cpu:{cores[-1]}"
    )
    engine = Engine.from_config(cfg, start_worker=True)
    try:
        assert engine.worker().info["kind"] == "process"
        ref = engine.generate_ids(PROMPT, DecodeConfig(mode="ar", max_new_tokens=60))
        gen_ = engine.generate_ids(PROMPT, DecodeConfig(mode="async", max_new_tokens=60))
        assert gen_.token_ids == ref.token_ids and gen_.stats.worker_failures == 0
        assert gen_.stats.branch_hits > 0 and gen_.stats.num_drafts > 0
    finally:
        engine.close()


def test_a_row_the_packed_shape_cannot_step_fails_alone(tiny_target):
    """A row whose slot cannot take the step's writes fails before the step, alone (it used to
    fail the step's packed forward, and with it every row's block in it)."""
    drafter = build_drafter("replay:5:0.5:self:1", LoadedModel(tiny_target, None, "tiny"))
    CudaBackend(graphs=False).prepare_drafter(drafter.lm)
    server = drafter.server(ServerConfig(fixed_branches=2))
    forwards = server.forwards
    assert isinstance(forwards, PackedShapeForwards)
    cap = forwards.packed.kv.capacity
    long = [j % 90 + 2 for j in range(cap - forwards.reserve - 2)]  # fits, with 2 to spare
    output = [9, 10, 11, 12, 13, 14, 15, 16]
    for sid, prompt in ((1, [5, 6, 7, 8]), (2, long)):
        opened = ReplayOpen(sid, prompt, SamplingConfig(), seed=sid, prepare=False, output=output)
        assert list(server.handle(opened)) == []
    out = list(server.handle(Commits([Commit(1, [9], 0.1), Commit(2, [9, 10, 11], 0.1)])))
    failed = [m for m in out if isinstance(m, Failed)]
    assert [m.sid for m in out if isinstance(m, Block)] == [1]
    assert [f.sid for f in failed] == [2] and f"at most {cap} tokens" in failed[0].message
    assert 2 not in server.rows and len(forwards.packed.kv.rows) == 1  # its slot is free
    block = next(m for m in out if isinstance(m, Block))
    out = list(server.handle(Commits([Commit(1, [*block.tokens[:1], 3], 0.1)])))
    assert [type(m) for m in out] == [Block]
