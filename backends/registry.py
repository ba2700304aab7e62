"""Backend factories keyed by the policy's ``type`` tag: the built-in ones in one table here (each
module's ``factory``; the modules never import this one, so the imports run one way), and any
``register``-ed beside them. Nothing here imports a name from YAML."""

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
    factory = _FACTORIES.get(spec.type) or _builtin().get(spec.type)
    if factory is None:
        raise ValueError(f"unknown backend type '{spec.type}'")
    return factory(name, spec)


def _builtin() -> dict[str, Factory]:
    """The built-in backends' factories, their modules imported when a policy is first built."""
    from backends import litellm_backend, llamacpp, openai_compat, probe, scorer, scripted

    return {
        "openai": openai_compat.factory,
        "litellm": litellm_backend.factory,
        "llamacpp": llamacpp.factory,
        "scripted": scripted.factory,
        "gguf_scorer": scorer.factory,
        "gguf_probe": probe.factory,
    }
