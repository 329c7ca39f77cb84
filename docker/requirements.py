"""Requirement lists for the image build (runs in the build stage: Python 3.11, no project code).

    python requirements.py pyproject.toml     build-system requires + runtime dependencies
    python requirements.py --lock REPORT      name==version of every package in a pip report

The first lets the image install the dependencies in a layer of their own (kept while only the
code changes) and the project itself later with ``--no-build-isolation --no-index`` (offline).
The second turns ``pip install --dry-run --report`` into the GPU image's lock: the GPU stage
resolves first (no CUDA downloaded, the step CI builds) and then installs exactly that set.
"""

from __future__ import annotations

import json
import sys

import tomllib


def requirements(pyproject: dict) -> list[str]:
    return [*pyproject["build-system"]["requires"], *pyproject["project"]["dependencies"]]


def lock(report: dict) -> list[str]:
    pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--lock":
        with open(argv[1]) as f:
            lines = lock(json.load(f))
    elif len(argv) == 1:
        with open(argv[0], "rb") as f:
            lines = requirements(tomllib.load(f))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
