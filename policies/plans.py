"""A requested model name, resolved once into a plan. Pure: no I/O.

Every door (the HTTP routes, the batch runner, a model tier of the cascade, embeddings, the batch
tokenizer) resolves a name here and nowhere else, into one of three plans:

- :class:`ChainPlan`: a policy model or an alias: the models to try in order (each target's
  fallbacks after it, the policy's fallback model last);
- :class:`EncoderPlan`: a ``semantic`` or ``routed`` virtual model: the encoder picks the model per
  request (then that model's chain); ``chain`` is what serves when nothing picks;
- :class:`TypedPlan`: a ``cascade`` virtual model: a typed question is decided by the cascade, any
  other request follows ``open``, the plan of its open route.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.errors import ModelNotFound
from policies.schema import AliasModel, CascadeModel, Policy, RoutedModel, SemanticModel


@dataclass(frozen=True)
class ChainPlan:
    name: str
    chain: tuple[str, ...]


@dataclass(frozen=True)
class EncoderPlan:
    name: str
    model: SemanticModel | RoutedModel
    chain: tuple[str, ...]  # without the encoder: the default, or a routed model's candidates dearest first


@dataclass(frozen=True)
class TypedPlan:
    name: str
    open: Plan

    @property
    def chain(self) -> tuple[str, ...]:
        return self.open.chain


Plan = ChainPlan | EncoderPlan | TypedPlan


def _price(policy: Policy, model: str) -> float:
    p = policy.models[model].prices
    return p.input_per_mtok + p.output_per_mtok + 1e6 * p.per_call


def public_models(policy: Policy) -> list[str]:
    return [*policy.models, *policy.virtual_models]


def _chain(policy: Policy, heads: list[str]) -> tuple[str, ...]:
    """``heads`` in order, each followed by its fallbacks, then the policy's fallback model."""
    chain: list[str] = []
    for head in heads:
        for name in (head, *policy.models[head].fallbacks):
            if name not in chain:
                chain.append(name)
    if policy.fallback_model is not None and policy.fallback_model not in chain:
        chain.append(policy.fallback_model)
    return tuple(chain)


def resolve(policy: Policy, name: str) -> Plan:
    """The plan for ``name``; :class:`ModelNotFound` (404) when the policy has no such model."""
    if name in policy.models:
        return ChainPlan(name, _chain(policy, [name]))
    vm = policy.virtual_models.get(name)
    if vm is None:
        raise ModelNotFound(f"The model '{name}' does not exist", param="model")
    if isinstance(vm, AliasModel):
        return ChainPlan(name, _chain(policy, list(vm.targets)))
    if isinstance(vm, CascadeModel):
        return TypedPlan(name, resolve(policy, vm.open))
    if isinstance(vm, RoutedModel):
        return EncoderPlan(name, vm, _chain(policy, sorted(vm.routes(), key=lambda m: -_price(policy, m))))
    return EncoderPlan(name, vm, _chain(policy, [vm.default]))
