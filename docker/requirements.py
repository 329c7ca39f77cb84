"""Requirement lists for the image build (runs in the build stage: Python 3.11, no project code).

    python requirements.py pyproject.toml     build-system requires + runtime dependencies
    python requirements.py --lock REPORT      name==version of every package in a pip report
    python requirements.py --freeze PYPROJECT name==version of the runtime dependencies and all
                                              they need, as installed here (``make docker-lock``)

The first lets the image install the dependencies in a layer of their own (kept while only the
code changes) and the project itself later with ``--no-build-isolation --no-index`` (offline).
The second turns ``pip install --dry-run --report`` into the GPU image's lock: the GPU stage
resolves first (no CUDA downloaded, the step CI builds) and then installs exactly that set. The
third writes ``lock-runtime.txt`` from the project's tested environment (its ``.venv``): the
runtime dependencies' closure at the versions the tests ran on, which both images install under
(``pip -c``), so a rebuild gets those versions and not whatever PyPI has that day. torch is left
out (each image pins its own build: ``+cpu`` or CUDA; its dependencies are in) and so are the
build requirements.
"""

from __future__ import annotations

import json
import re
import sys

import tomllib


def requirements(pyproject: dict) -> list[str]:
    return [*pyproject["build-system"]["requires"], *pyproject["project"]["dependencies"]]


def lock(report: dict) -> list[str]:
    pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def freeze(pyproject: dict, skip: tuple[str, ...] = ("torch",)) -> list[str]:
    """The installed closure of the runtime dependencies (markers of this interpreter; no
    extras but those asked for), as ``name==version``."""
    from importlib import metadata

    from packaging.requirements import Requirement

    todo = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    pins: dict[str, str] = {}
    while todo:
        req = todo.pop()
        name = _name(req.name)
        if name in pins:
            continue
        dist = metadata.distribution(req.name)
        pins[name] = dist.version  # torch too, for now: its own dependencies are walked
        for raw in dist.requires or []:
            sub = Requirement(raw)
            envs = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append(sub)
    return [f"{n}=={v}" for n, v in sorted(pins.items()) if n not in skip]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--freeze":
        with open(argv[1], "rb") as f:
            lines = freeze(tomllib.load(f))
    elif len(argv) == 2 and argv[0] == "--lock":
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
