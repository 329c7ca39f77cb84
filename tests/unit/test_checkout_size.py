"""The checkout travels to a GPU host for the GPU check, which takes at most 64 MiB with what is
carried beside it: the tracked tree stays at most 60 MiB."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 60 << 20


def test_tracked_tree_fits_the_copy_to_a_gpu_host():
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / p for p in out.decode().split("\0") if p]
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total <= LIMIT, f"tracked files weigh {total / 2**20:.1f} MiB, over 60 MiB"
