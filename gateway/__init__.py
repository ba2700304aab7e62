"""triage's gateway: the HTTP edge (``triage serve``), the CLI, and the Python API exported here.

``from gateway import Gateway`` serves a policy in the program's own process (docs/python.md).
Importing this package starts nothing and imports no web framework, engine or encoder runtime:
each name below is imported when it is first asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.embedded import AsyncGateway, Gateway, Routing
    from policies.cascade import Decision
    from policies.errors import TriageError

__all__ = ["AsyncGateway", "Decision", "Gateway", "Routing", "TriageError"]

_HOME = {  # each exported name's module
    "AsyncGateway": "gateway.embedded",
    "Gateway": "gateway.embedded",
    "Routing": "gateway.embedded",
    "Decision": "policies.cascade",
    "TriageError": "policies.errors",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'gateway' has no attribute {name!r}")
    return getattr(import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
