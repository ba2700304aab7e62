"""triage's Python API: a policy served in the program's own process (:class:`Gateway`, and
:class:`AsyncGateway` for a program with an event loop). Reached as ``from gateway import Gateway``:
``gateway/__init__.py`` imports this package only when one of its names is asked for."""

from gateway.embedded.aio import AsyncGateway, Routing
from gateway.embedded.sync import Gateway

__all__ = ["AsyncGateway", "Gateway", "Routing"]
