"""Prices and context windows of known provider models, from litellm's catalogue.

litellm (a dependency: the ``litellm`` backend) ships a catalogue of the providers' models with
their prices per token and their context windows (``model_prices_and_context_window_backup.json``
in its package, versioned with it: the figures are those of the pinned litellm). A model on a
``litellm`` backend whose policy gives no ``prices`` takes them from there, and one with no
``context_length`` its ``max_input_tokens``; the policy's own figures always win.
:func:`sources` says where each figure came from (``triage validate --explain``).

The file is read as local data (no import of litellm, no network); where it is missing or a name
is not in it, the policy is left as it is: a lookup never fails a policy or a request.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from policies.schema import ModelSpec, Policy, Prices

FILE = "model_prices_and_context_window_backup.json"


@functools.lru_cache(maxsize=1)
def entries() -> dict[str, dict[str, Any]]:
    """The catalogue, by model name; empty where litellm or its file is missing."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


@functools.lru_cache(maxsize=1)
def version() -> str:
    try:
        return importlib.metadata.version("litellm")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def lookup(upstream: str) -> tuple[str, dict[str, Any]] | None:
    """The catalogue's entry for a litellm model string (``gpt-4o``, ``openai/gpt-4o``,
    ``anthropic/claude-...``): the name as given, else without its provider prefix."""
    known = entries()
    for name in (upstream, upstream.split("/", 1)[-1]):
        if name in known:
            return name, known[name]
    return None


def _filled(spec: ModelSpec, upstream: str) -> tuple[dict[str, Any], dict[str, str]]:
    found = lookup(upstream)
    if found is None:
        return {}, {}
    name, entry = found
    where = f"litellm {version()} catalogue: {name}"
    update: dict[str, Any] = {}
    said: dict[str, str] = {}
    cost_in, cost_out = entry.get("input_cost_per_token"), entry.get("output_cost_per_token")
    if "prices" not in spec.model_fields_set and isinstance(cost_in, int | float) and isinstance(cost_out, int | float):
        update["prices"] = Prices(input_per_mtok=cost_in * 1e6, output_per_mtok=cost_out * 1e6)
        said["prices"] = where
    window = entry.get("max_input_tokens")
    if spec.context_length is None and isinstance(window, int) and window > 0:
        update["context_length"] = window
        said["context_length"] = where
    return update, said


def fill(policy: Policy) -> Policy:
    """``policy`` with the catalogue's prices and context windows where it gives none (models on
    ``litellm`` backends only: an engine you run has no list price)."""
    models = dict(policy.models)
    changed = False
    for name, spec in policy.models.items():
        if policy.backends[spec.backend].type != "litellm":
            continue
        update, _ = _filled(spec, policy.upstream_name(name))
        if update:
            models[name] = spec.model_copy(update=update)
            changed = True
    return policy.model_copy(update={"models": models}) if changed else policy


def sources(policy: Policy) -> dict[str, dict[str, str]]:
    """model -> {field: where it came from} for the prices and context windows of ``policy``
    (as written, before :func:`fill`): ``policy`` where it says so, the catalogue where it would
    fill them, ``default`` where neither (no price: free; no window: the engine's, if it says)."""
    out: dict[str, dict[str, str]] = {}
    for name, spec in policy.models.items():
        said: dict[str, str] = {}
        if policy.backends[spec.backend].type == "litellm":
            said = _filled(spec, policy.upstream_name(name))[1]
        out[name] = {
            "prices": "policy" if "prices" in spec.model_fields_set else said.get("prices", "default"),
            "context_length": "policy" if spec.context_length is not None else said.get("context_length", "default"),
        }
    return out
