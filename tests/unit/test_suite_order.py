"""The suite's own scheduling hint names files that exist: a renamed test file would otherwise
drop out of ``LONGEST_FIRST`` silently and start late in ``make test``'s two processes."""

from pathlib import Path

from tests.scheduling import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_named_longest_first_exists():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [name for name in LONGEST_FIRST if not (ROOT / name).is_file()] == []
