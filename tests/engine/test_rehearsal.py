"""The rehearsal of CUDA graphs on the CPU (d3d.backends.cuda.rehearsal): it fails each kind of
step a graph would replay wrongly or refuse to capture, and passes the backend's own steps, whose
rehearsed outputs equal their eager outputs exactly (every mode's decoding through them:
test_cuda_backend.py, test_cuda_drafter.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from d3d.backends.cuda.graphs import Eager
from d3d.backends.cuda.rehearsal import GraphHazard, Rehearsal, runner_for


@dataclass(frozen=True)
class Inputs:
    ids: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]

    def fill(self, lengths: list[int]) -> Inputs:
        """New values at the same addresses, as a step target writes its graph's inputs."""
        self.lengths.copy_(torch.tensor(lengths))
        self.ids.add_(1)
        return self


def inputs(lengths: list[int], width: int = 2) -> Inputs:
    return Inputs(
        torch.arange(len(lengths) * width).view(len(lengths), width), torch.tensor(lengths)
    )


TABLE = torch.linspace(0, 1, 64)


def good(x: Inputs, n: int) -> torch.Tensor:
    """What a graph may do: read its inputs' values on the device only."""
    limit = x.lengths[:, None] + torch.arange(1, x.ids.shape[1] + 1)  # [B, T]
    keys = torch.arange(n)
    return torch.where(keys < limit[..., None], TABLE[:n], 0.0).sum(-1) + x.ids


def test_the_runner_is_a_graph_on_a_gpu_its_rehearsal_elsewhere_and_eager_when_asked():
    assert isinstance(runner_for(good, True, torch.device("cpu")), Rehearsal)
    assert isinstance(runner_for(good, False, torch.device("cpu")), Eager)


def test_a_step_that_reads_only_its_inputs_on_the_device_rehearses_as_eager():
    r, x = Rehearsal(good), inputs([3, 5])
    first = r.run(x, 16)
    assert torch.equal(first, good(x, 16))
    again = r.run(x.fill([9, 1]), 16)  # the same shape, other values: a replay
    assert again is first, "a shape's later calls return its first output, as a graph's replay"
    assert torch.equal(again, good(x, 16))
    r.run(inputs([9, 1, 2]), 16)
    assert r.shapes == r.captured == 2


def test_inputs_at_another_address_are_caught():
    r = Rehearsal(good)
    r.run(inputs([3, 5]), 16)
    with pytest.raises(GraphHazard, match="differs from the captured one"):
        r.run(inputs([3, 5]), 16)  # equal values, but the graph reads the first call's tensors


def reads_the_host(x: Inputs, n: int) -> torch.Tensor:
    return x.ids[:, : int(x.lengths.max())]  # a bound read from the device


def makes_host_data(x: Inputs, n: int) -> torch.Tensor:
    return x.ids + torch.tensor([1, 2])


def boolean_index(x: Inputs, n: int) -> torch.Tensor:
    return x.ids[x.lengths > 3]


def nonzero(x: Inputs, n: int) -> torch.Tensor:
    return torch.where(x.lengths > 3)[0]


@pytest.mark.parametrize(
    "step, says",
    [
        (reads_the_host, "reads the host"),
        (makes_host_data, "host data"),
        (boolean_index, "boolean index"),
        (nonzero, "reads the host"),
    ],
)
def test_a_step_a_graph_cannot_hold_fails_at_once(step, says):
    with pytest.raises(GraphHazard, match=says):
        Rehearsal(step).run(inputs([3, 5]), 16)
    assert Eager(step).run(inputs([3, 5]), 16) is not None  # eagerly it runs


class State:
    """Steps that read more than their inputs: a number kept on the host, a rebuilt table, or
    their own inputs changed."""

    def __init__(self):
        self.length = 3
        self.table = torch.ones(16)

    def number(self, x: Inputs, n: int) -> torch.Tensor:
        return x.ids.narrow(1, 0, 1) + self.length  # a graph keeps the first call's length

    def table_read(self, x: Inputs, n: int) -> torch.Tensor:
        return x.ids.sum() + self.table[:n].sum()

    def counts_itself(self, x: Inputs, n: int) -> torch.Tensor:
        x.lengths.add_(1)  # a graph's warm-up and replay both run it
        return x.lengths * 2


def test_a_number_kept_on_the_host_is_caught_on_the_next_call():
    s, x = State(), inputs([3, 5])
    r = Rehearsal(s.number)
    r.run(x, 16)
    r.run(x.fill([4, 6]), 16)  # the same number: a replay would be right
    s.length = 4
    with pytest.raises(GraphHazard, match="differs from the captured one"):
        r.run(x.fill([5, 7]), 16)


def test_a_table_rebuilt_between_calls_is_caught():
    s, x = State(), inputs([3, 5])
    r = Rehearsal(s.table_read)
    r.run(x, 16)
    s.table = torch.ones(16)  # the same values at another address: the graph reads the old one
    with pytest.raises(GraphHazard, match="differs from the captured one"):
        r.run(x, 16)
    r = Rehearsal(s.table_read)  # while values written in place are what a graph reads
    r.run(x, 16)
    s.table.fill_(3)
    assert float(r.run(x, 16)) == float(x.ids.sum()) + 48


def test_a_step_that_changes_its_own_inputs_is_caught_at_capture():
    with pytest.raises(GraphHazard, match="second run differs"):
        Rehearsal(State().counts_itself).run(inputs([3, 5]), 16)
