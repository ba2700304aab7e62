"""Backend factories keyed by the policy's ``type`` tag. Nothing here imports a name from YAML."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backends.base import Backend

Factory = Callable[[str, Any], Backend]

_FACTORIES: dict[str, Factory] = {}


def register(type_: str) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        if type_ in _FACTORIES:
            raise ValueError(f"backend type '{type_}' registered twice")
        _FACTORIES[type_] = factory
        return factory

    return deco


def build(name: str, spec: Any) -> Backend:
    """Build the backend for one policy entry (``spec`` is its pydantic model)."""
    _load_builtin()
    try:
        factory = _FACTORIES[spec.type]
    except KeyError:
        raise ValueError(f"unknown backend type '{spec.type}'") from None
    return factory(name, spec)


def _load_builtin() -> None:
    # The built-in backends register themselves when their module is imported.
    from backends import litellm_backend, llamacpp, openai_compat, probe, scorer, scripted  # noqa: F401
