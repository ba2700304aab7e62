"""The test lanes. ``make test-fast`` runs ``pytest -m "not engine and not model and not fleet"``
in a light virtualenv (no llama-cpp-python, no torch, no model package): the pure core and the HTTP
edge on scripted backends, in under two minutes. ``make test`` runs every test but the engine and
model ones there (the fleet's too), then those in the full virtualenv.

A test is marked by what it starts or loads, and the fixture that does it says so where it is
defined, under ``@pytest.fixture``: ``@lanes.engine`` (it starts an inference engine),
``@lanes.model`` (it loads a model) or ``@lanes.fleet`` (it starts Redis, PostgreSQL or gateway
processes). :func:`mark` gives every test whose fixture closure holds such a fixture its marker. A
test that starts or loads one itself carries the marker (``pytestmark`` on its module, or
``@pytest.mark.model`` on it).

:func:`guard` keeps the light tests light in any lane: a test with neither marker that imports
torch or llama-cpp-python in the test's process, or opens from Python a GGUF or ONNX file that the
tests did not write (a fake GGUF in a test's temporary folder is no model), fails and says what it
touched.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

# the markers, registered in pyproject.toml
ENGINE = "engine"  # starts an inference engine: llama.cpp's server, vLLM, a local model's worker
MODEL = "model"  # loads a model: a GGUF file, the encoder (exported with torch, run by ONNX Runtime)
HEAVY = (ENGINE, MODEL)  # what the light virtualenv cannot run
FLEET = "fleet"  # starts the fleet's servers: Redis, PostgreSQL, gateway processes of its own

_declared: dict[str, str] = {}  # fixture name -> its marker, filled by the decorators below


def _declare(marker: str) -> Callable[[F], F]:
    def declare(fn: F) -> F:
        name = fn.__name__
        if _declared.setdefault(name, marker) != marker:
            raise RuntimeError(f"fixture {name!r} is declared both {_declared[name]!r} and {marker!r}")
        return fn

    return declare


engine = _declare(ENGINE)
model = _declare(MODEL)
fleet = _declare(FLEET)


def mark(items: list[pytest.Item]) -> None:
    """Each test gets the marker of every heavy fixture in its closure (fixtures it asks for, and
    those they ask for)."""
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            if (marker := _declared.get(name)) is not None:
                item.add_marker(marker)


# --- the guard -----------------------------------------------------------------------------------

HEAVY_MODULES = ("torch", "llama_cpp", "transformers", "sentence_transformers")
MODEL_FILES = (".gguf", ".onnx")

_watching = threading.Event()  # set while a light test runs (the hook sees every thread's events)
_touched: list[str] = []
_own = ""  # the session's temporary folder: what the tests wrote themselves


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not _watching.is_set():
        return
    if event == "import" and str(args[0]).split(".", 1)[0] in HEAVY_MODULES:
        _touched.append(f"imported {args[0]}")
    elif (
        event == "open" and isinstance(args[0], str) and args[0].endswith(MODEL_FILES) and not args[0].startswith(_own)
    ):
        _touched.append(f"opened {args[0]}")


_hooked = False


@contextmanager
def guard(item: pytest.Item) -> Iterator[None]:
    """Around a test's setup, call and teardown: fails a light test that touched a heavy module or
    a model file."""
    global _hooked, _own
    if any(item.get_closest_marker(m) is not None for m in HEAVY):
        yield
        return
    if not _hooked:
        _own = str(item.config._tmp_path_factory.getbasetemp()) + os.sep  # type: ignore[attr-defined]
        sys.addaudithook(_hook)  # for the rest of the process: audit hooks cannot be removed
        _hooked = True
    _touched.clear()
    _watching.set()
    try:
        yield
    finally:
        _watching.clear()
    if _touched:
        touched = sorted(set(_touched))
        pytest.fail(
            f"a test without the engine or model marker {', '.join(touched)}: "
            "declare the fixture that does it (tests/lanes.py) or mark the test",
            pytrace=False,
        )


class Checks:
    """The hooks, registered as a plugin (``pytest_configure`` in conftest.py): a conftest's own
    hooks are not called for session fixtures, which belong to no folder."""

    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
        """A declared fixture set up for a test without its marker: asked for by name at run time
        (``request.getfixturevalue``), out of the closure :func:`mark` reads. Such a test carries
        the marker itself (``pytest.param(..., marks=...)``). In a lane without that marker the
        fixture is always first set up for such a test, so the lane never runs it unmarked."""
        marker = _declared.get(fixturedef.argname)
        item = getattr(request, "_pyfuncitem", None)
        if marker is not None and item is not None and item.get_closest_marker(marker) is None:
            pytest.fail(f"{item.nodeid} asks for {fixturedef.argname!r} ({marker}) without the marker", pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        with guard(item):  # a light test touches no heavy module and no model file
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        with guard(item):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        with guard(item):
            return (yield)
