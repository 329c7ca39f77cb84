"""The order in which ``make test``'s two test processes take the test files (a pytest plugin,
loaded by ``tests/conftest.py``).

pytest-xdist (``--dist loadfile --no-loadscope-reorder``) hands out whole files in collection
order; the longest go first here and the many short files fill in behind them, so the two
processes end close together. Only the order changes, and only under xdist.
"""

from __future__ import annotations

import os

import pytest

# Longest first: from about 180 s down to 30 s each in `make test`'s two processes (stop 52).
LONGEST_FIRST = (
    "tests/vllm/test_vllm_service.py",
    "tests/engine/test_default_model.py",
    "tests/api/test_docker_image.py",
    "tests/engine/test_training_distributed.py",
    "tests/vllm/test_vllm_proposer.py",
    "tests/api/test_ray_serve.py",
    "tests/engine/test_penalties_exact.py",
    "tests/vllm/test_vllm_data.py",
    "tests/api/test_openai_sdk.py",
    "tests/engine/test_async_lossless.py",
    "tests/vllm/test_vllm_no_drafter.py",
    "tests/engine/test_question_scorer.py",
    "tests/engine/test_drafters_any_target.py",
    "tests/engine/test_needles.py",
    "tests/api/test_deploy.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: file order
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
