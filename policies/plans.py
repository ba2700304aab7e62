"""A requested model name, resolved once into a plan. Pure: no I/O.

Every door (the HTTP routes, the batch runner, a model tier of the cascade, embeddings, the batch
tokenizer) resolves a name here and nowhere else, into one of three plans:

- :class:`ChainPlan`: a policy model or an alias: the models to try in order (each target's
  fallbacks after it, the policy's fallback model last);
- :class:`EncoderPlan`: a ``semantic`` or ``routed`` virtual model: the encoder picks the model per
  request (then that model's chain); ``chain`` is what serves when nothing picks; ``reasoning``:
  the routed model that switches reasoning per request (``reasoning: {mode: router}``), resolved;
- :class:`TypedPlan`: a ``cascade`` virtual model: a typed question is decided by ``cascade`` (the
  policy's; None without one), any other request follows ``open``, the plan of its open route;
- :class:`SplitPlan`: a ``split`` virtual model: each request goes to one target by weight
  (:func:`split_target`, sticky per caller), then follows that target's plan.

A plan holds everything a request needs of the policy, so nothing after it looks a name up again.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass

from policies.errors import ModelNotFound
from policies.schema import AliasModel, CascadeModel, Policy, RoutedModel, SemanticModel, SplitModel
from policies.tiers import Cascade, ModelTier


@dataclass(frozen=True)
class ChainPlan:
    name: str
    chain: tuple[str, ...]


@dataclass(frozen=True)
class EncoderPlan:
    name: str
    model: SemanticModel | RoutedModel
    chain: tuple[str, ...]  # without the encoder: the default, or a routed model's candidates dearest first
    reasoning: tuple[str, RoutedModel] | None = None  # a semantic model's reasoning router: its name, its model


@dataclass(frozen=True)
class TypedPlan:
    name: str
    open: Plan
    cascade: Cascade | None  # the policy's (a typed question without one follows ``open`` too)

    @property
    def chain(self) -> tuple[str, ...]:
        return self.open.chain


@dataclass(frozen=True)
class SplitPlan:
    name: str
    targets: tuple[tuple[str, float], ...]  # in the policy's order, with their weights
    sticky: str  # user | key | session | none

    @property
    def chain(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.targets)


def split_target(plan: SplitPlan, who: str | None, targets: tuple[tuple[str, float], ...] | None = None) -> str:
    """The target of ``plan`` for the caller ``who`` (its sticky id): the same caller, the same
    target while the weights stay; None draws anew. A point in [0, 1) from the split's name and
    the id, placed on the weights laid end to end (``targets``: the plan's, or the same weights
    with rolled-back targets renamed)."""
    targets = plan.targets if targets is None else targets
    if who is None:
        u = random.random()
    else:
        digest = hashlib.blake2b(f"{plan.name}|{who}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        u = int.from_bytes(digest, "big") / 2**64
    total = sum(w for _, w in targets)
    point = u * total
    for target, weight in targets:
        point -= weight
        if point < 0:
            return target
    return targets[-1][0]


Plan = ChainPlan | EncoderPlan | TypedPlan | SplitPlan


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
        return TypedPlan(name, resolve(policy, vm.open), policy.cascade)
    if isinstance(vm, SplitModel):
        return SplitPlan(name, tuple(vm.targets.items()), vm.sticky)
    if isinstance(vm, RoutedModel):
        return EncoderPlan(name, vm, _chain(policy, sorted(vm.routes(), key=lambda m: -_price(policy, m))))
    return EncoderPlan(name, vm, _chain(policy, [vm.default]), _reasoning_router(policy, vm))


def _reasoning_router(policy: Policy, vm: SemanticModel) -> tuple[str, RoutedModel] | None:
    """``reasoning: {mode: router}``: the routed model that switches reasoning (validated to be one)."""
    name = vm.reasoning.router
    if name is None:
        return None
    router = policy.virtual_models[name]
    assert isinstance(router, RoutedModel), "validated: mode router names a routed model"
    return name, router


def reach(policy: Policy, names: Iterable[str]) -> frozenset[str]:
    """Every model a key that lists ``names`` may be served by: each name, and what its plan may
    pick (a chain's fallbacks, an encoder's routes, a cascade model's tiers and open route), to
    the end. A key may ask only for the names it lists; what those names route to comes with them."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            plan = resolve(policy, name)
        except ModelNotFound:  # validated away for a policy's keys; a store key may outlive a model
            continue
        todo.extend(plan.chain)
        if isinstance(plan, EncoderPlan):
            todo.extend(plan.model.routes())
        if isinstance(plan, TypedPlan):
            todo.append(plan.open.name)
            tiers = policy.cascade.tiers if policy.cascade is not None else []
            todo.extend(t.model for t in tiers if isinstance(t, ModelTier))
    return frozenset(seen)
