"""Where the drafter worker goes, from device specs and the host's cores."""

import pytest

from d3d.engine.placement import (
    Placement,
    PlacementError,
    parse_cores,
    resolve_placement,
    torch_device,
)


def test_parse_cores():
    assert parse_cores("1") == (1,)
    assert parse_cores("2-3") == (2, 3)
    assert parse_cores("0,2,5-6") == (0, 2, 5, 6)
    for bad in ("", "a", "3-1", "-1", "1,,x"):
        with pytest.raises(PlacementError, match="core list"):
            parse_cores(bad)


def test_default_cpu_host_with_two_cores_gives_the_drafter_its_own_core():
    assert resolve_placement("cpu", None, [0, 1]) == Placement("process", "cpu", (1,), (0,))
    assert resolve_placement("cpu", None, [0, 1, 2, 3]) == Placement(
        "process", "cpu", (3,), (0, 1, 2)
    )


def test_one_core_or_plain_cpu_keeps_the_drafter_in_a_thread():
    assert resolve_placement("cpu", None, [0]) == Placement("thread", "cpu")
    assert resolve_placement("cpu", "cpu", [0, 1]) == Placement("thread", "cpu")


def test_explicit_cores():
    assert resolve_placement("cpu", "cpu:2-3", [0, 1, 2, 3]) == Placement(
        "process", "cpu", (2, 3), (0, 1)
    )
    with pytest.raises(PlacementError, match="not available"):
        resolve_placement("cpu", "cpu:5", [0, 1])


def test_gpus_use_a_thread_on_the_drafter_device():
    assert resolve_placement("cuda:0", "cuda:1", [0, 1]) == Placement("thread", "cuda:1")
    assert resolve_placement("cuda:0", None, [0, 1]) == Placement("thread", "cuda:0")


def test_torch_device():
    assert torch_device("cpu:1") == "cpu" and torch_device("cuda:1") == "cuda:1"
