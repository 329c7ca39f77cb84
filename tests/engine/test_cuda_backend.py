"""The cuda backend's step code, run on the CPU (everything but the capture): decode steps over
fixed slots give the reference's logits, and every mode decodes through it exactly as ``ar``
does, alone and in batches with rows joining, leaving and moving slots. On a GPU the same steps
replayed from CUDA graphs give the eager step's logits."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from d3d.backends import choose
from d3d.backends.cuda import CudaBackend, CudaTarget
from d3d.backends.cuda.forward import StepInputs, attended, unfit
from d3d.backends.cuda.graphs import Graphs
from d3d.backends.cuda.kv import MIN_CAPACITY, SlotLimitError, StaticKV, static_shape
from d3d.backends.cuda.rehearsal import Rehearsal
from d3d.backends.reference import ReferenceBackend
from d3d.engine import GenRequest
from d3d.model.drafter import D3DDrafter
from tests.conftest import TINY_VOCAB, greedy_continuation, tiny_engine, tiny_model

MODES = ("ar", "sync", "async", "auto")


def test_slots_and_capacity_follow_the_budget_and_the_rows():
    assert static_shape(64 * 4096, 64, 40960) == (64, 4096)  # every row its share
    assert static_shape(340_000, 32, 40960) == (32, 10_688)  # rounded up to 64 positions
    assert static_shape(8192, 32, 40960) == (8, MIN_CAPACITY)  # fewer rows of a useful length
    assert static_shape(544, 1, 8192) == (1, 576)  # one row: all of the budget
    assert static_shape(10**9, 4, 2048) == (4, 2048)  # never past the window


def test_keys_attended_cover_the_longest_row_within_a_quarter():
    assert attended(1, 4096) == 256 and attended(257, 4096) == 512
    assert attended(1025, 8192) == 1280 and attended(700, 8192) == 768  # not 2,048 and 1,024
    assert attended(3000, 4096) == 3072 and attended(3000, 2048) == 2048
    shapes = {attended(n, 1 << 20) for n in range(4097, 8193)}
    assert shapes == {5120, 6144, 7168, 8192}  # four a doubling
    for n in range(1, 20000, 7):
        assert n <= attended(n, 1 << 20) <= max(n + 255, 1.25 * n)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("laid_out", [False, True])  # the backend's prepare: one product for qkv
def test_decode_steps_over_slots_give_the_reference_logits(kind, laid_out):
    model = tiny_model(kind, seed=1)
    if laid_out:
        CudaBackend(graphs=False).prepare(model)
    got = CudaBackend(graphs=False).target(model, 8 * MIN_CAPACITY, rows=4, block=6)
    assert all(x is not None for x in got.step.qkv) == laid_out
    want = ReferenceBackend().target(model, 8 * MIN_CAPACITY)
    assert isinstance(got, CudaTarget)
    rows = {id(t): [t.kv.open(200) for _ in range(3)] for t in (got, want)}
    gen = torch.Generator().manual_seed(0)
    # prompts (eager), plain steps, verify steps of mixed widths (padded), a short last chunk
    for widths in ((7, 3, 12), (1, 1, 1), (6, 1, 6), (1, 1, 1), (4, 6, 2)):
        ids = [torch.randint(TINY_VOCAB, (w,), generator=gen).tolist() for w in widths]
        keep = [None, [0], None]
        a, b = (t.forward(rows[id(t)], ids, keep) for t in (got, want))
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        for t in (got, want):
            for row, w in zip(rows[id(t)], widths, strict=True):
                t.kv.commit(row, w)
    assert got.counts == {"decode": 4, "eager": 1}
    # a row leaves: the last row moves into its slot, and the rest still decode as before
    for t in (got, want):
        t.kv.close(rows[id(t)].pop(0))
    ids = [[5], [9]]
    a, b = (t.forward(rows[id(t)], ids) for t in (got, want))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert got.counts["decode"] == 5


def test_a_request_longer_than_a_slot_is_refused_naming_the_limit():
    model = tiny_model("llama", seed=1)
    target = CudaBackend(graphs=False).target(model, 2 * MIN_CAPACITY, rows=2)
    assert isinstance(target.kv, StaticKV) and target.kv.capacity == 512  # the tiny window
    with pytest.raises(SlotLimitError, match="holds at most 512 tokens on the cuda backend"):
        target.kv.check(600)
    assert target.kv.fits(500) and not target.kv.fits(600)


def test_a_model_of_another_form_runs_the_reference():
    model = tiny_model("llama", seed=1)
    model.model.rotary_emb = None
    assert unfit(model)
    target = CudaBackend(graphs=False).target(model, 4096)
    assert not isinstance(target, CudaTarget)


def test_a_disagreeing_sample_runs_the_reference_unless_trusted(monkeypatch):
    from d3d.backends import check

    model = tiny_model("qwen3", seed=2)
    assert CudaBackend(graphs=False).report(model)["agrees"]  # the real check passes
    monkeypatch.setattr(check, "tolerance", lambda dtype: -1.0)  # now nothing can agree
    report = CudaBackend(graphs=False).report(model)
    assert not report["agrees"] and 0 <= report["relative_error"] < 1e-4
    assert not isinstance(CudaBackend(graphs=False).target(model, 4096), CudaTarget)
    assert isinstance(CudaBackend(graphs=False, trust=True).target(model, 4096), CudaTarget)


def test_a_sample_that_raises_runs_the_reference_even_trusted(monkeypatch):
    """A capture the device refuses, or a kernel that does not take the shapes, fails the
    load-time sample: the reference runs the model, trusted or not, and the report says why."""
    from d3d.backends import check

    def refused(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(check, "sample_error", refused)
    model = tiny_model("qwen3", seed=3)
    for trust in (False, True):
        assert not isinstance(
            CudaBackend(graphs=False, trust=trust).target(model, 4096), CudaTarget
        )
    report = CudaBackend(graphs=False).report(model)
    assert not report["agrees"] and "not permitted when stream is capturing" in report["failed"]


def test_auto_picks_cuda_on_a_gpu_and_the_cpu_backend_here():
    assert choose("auto", "cpu").name == "cpu"
    assert choose("cuda", "cpu").name == "cuda" and not choose("cuda", "cpu").graphs
    assert choose("reference", "cpu").name == "reference"


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 90 + 2 for j in range(3 + (11 * i) % 37)] for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [1, 6])
def test_every_mode_through_the_cuda_step_equals_ar(kind, rows):
    """Through the steps as their graphs would run them (here: rehearsed, each call held to
    its shape's first, d3d.backends.cuda.rehearsal)."""
    model = tiny_model(kind, seed=1)
    CudaBackend(graphs=False).prepare(model)  # as Engine.from_config does, before the drafter
    drafter = D3DDrafter.from_target(model, 1, base="tiny", block_size=6)
    engine = tiny_engine(model, drafter, backend=CudaBackend(graphs=True))
    try:
        sched = engine.scheduler(max_batch=8)
        assert isinstance(sched.target, CudaTarget)
        assert isinstance(sched.target.runner, Rehearsal)
        sched.eos_ids = set()
        ps = prompts(rows)
        out: list[list[int]] = [[] for _ in ps]
        budgets = [12 + (5 * i) % 17 for i in range(rows)]
        for i in range(rows):  # half start together, the rest join one per step
            sched.add(GenRequest(ps[i], budgets[i], mode=MODES[i % 4], on_tokens=out[i].extend))
            if i >= rows // 2:
                sched.step()
        while not sched.idle:
            sched.step()
        for i in range(rows):
            want = greedy_continuation(model, ps[i], budgets[i])
            assert out[i] == want, f"row {i} ({MODES[i % 4]})"
        assert sched.target.counts["decode"] > sched.target.counts["eager"]
        assert sched.target.runner.captured >= 1
    finally:
        engine.close()


def test_eager_steps_count_the_shapes_graphs_would_capture():
    """The GPU check's ``new_shapes`` (a graph captured inside a measured run) reads the same
    count on a CPU: a shape per (rows bucket, width, keys attended), repeats not counted."""
    model = tiny_model("qwen3", seed=1)
    t = CudaBackend(graphs=False).target(model, 8 * MIN_CAPACITY, rows=4, block=6)
    rows = [t.kv.open(200) for _ in range(3)]
    met = []
    for widths in ((7, 3, 12), (1, 1, 1), (6, 1, 6), (1, 1, 1), (1, 1)):
        t.forward(rows[: len(widths)], [[1] * w for w in widths])
        for row, w in zip(rows, widths, strict=False):
            t.kv.commit(row, w)
        met.append(t.runner.shapes)
    assert met == [0, 1, 2, 2, 2]  # a prompt step is eager; T 1, then T 6; B stays 4 (3 live)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_captured_steps_give_the_eager_steps_logits(device):
    """On a GPU, CUDA graphs; on the CPU, their rehearsal (d3d.backends.cuda.rehearsal)."""
    model = tiny_model("qwen3", seed=1).to(device)
    steps = {}
    for graphs in (True, False):
        t = CudaBackend(graphs=graphs).target(model, 8 * MIN_CAPACITY, rows=4, block=6)
        rows = [t.kv.open(200) for _ in range(3)]
        gen = torch.Generator().manual_seed(0)
        outs = []
        for widths in ((7, 3, 12), (1, 1, 1), (6, 1, 6), (1, 1, 1), (6, 6, 6)):
            ids = [torch.randint(TINY_VOCAB, (w,), generator=gen).tolist() for w in widths]
            outs.append(torch.cat(t.forward(rows, ids)).cpu())
            for row, w in zip(rows, widths, strict=True):
                t.kv.commit(row, w)
        steps[graphs] = outs
        assert t.runner.shapes == 2  # (B 4, T 1) and (B 4, T 6), n 256: captured or not
        if graphs:
            assert t.runner.captured == 2
    for a, b in zip(steps[True], steps[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _FakeCuda:
    """Just enough of ``torch.cuda`` for :class:`Graphs` to capture on a CPU: it records each
    capture's stream and mode and how many captures were under way at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = self.most = 0
        self.captures: list[tuple[object, str]] = []

    def install(self, monkeypatch) -> None:
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.device = device

            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def pool(self):
                return "pool"

            def replay(self):
                pass

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            with fake.lock:
                fake.active += 1
                fake.most = max(fake.most, fake.active)
                fake.captures.append((stream, capture_error_mode))
            try:
                yield
            finally:
                with fake.lock:
                    fake.active -= 1

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: Stream(d))


def test_two_threads_capture_one_at_a_time_each_on_its_own_stream(monkeypatch):
    """The engine's target and a drafter worker's thread capture in one process: each
    :class:`Graphs` captures on a stream of its own on its inputs' device, in thread-local mode,
    never while the other captures (d3d.backends.cuda.graphs)."""
    fake = _FakeCuda()
    fake.install(monkeypatch)

    def step(x: StepInputs, n: int) -> torch.Tensor:
        time.sleep(0.01)  # a capture long enough for the other thread to try its own
        return x.ids.float().sum() + n

    runners = [Graphs(step), Graphs(step)]
    got: dict[int, list[float]] = {0: [], 1: []}

    def drive(i: int) -> None:
        for rows in (1, 2, 4, 1, 2):
            x = StepInputs.empty(rows, 1 + i, torch.device("cpu"))
            got[i].append(float(runners[i].run(x, 256)))

    threads = [threading.Thread(target=drive, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: [256.0] * 5, 1: [256.0] * 5}
    assert [r.captured for r in runners] == [3, 3]  # rows 1, 2, 4; the repeats replay
    assert fake.most == 1, "two captures were under way at once"
    streams = {id(s) for s, _ in fake.captures}
    assert streams == {id(r.stream) for r in runners} and len(streams) == 2
    assert all(s.device == torch.device("cpu") for s, _ in fake.captures)  # the inputs' device
    assert {mode for _, mode in fake.captures} == {"thread_local"}
