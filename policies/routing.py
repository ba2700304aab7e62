"""Which policy models may serve a requested model name, in order. Pure: no I/O."""

from __future__ import annotations

from policies.errors import ModelNotFound
from policies.schema import AliasModel, CascadeModel, Policy, RoutedModel


def _price(policy: Policy, model: str) -> float:
    p = policy.models[model].prices
    return p.input_per_mtok + p.output_per_mtok + 1e6 * p.per_call


def public_models(policy: Policy) -> list[str]:
    return [*policy.models, *policy.virtual_models]


def candidates(policy: Policy, requested: str) -> list[str]:
    """The models to try for ``requested``: its own chain, then the policy's fallback model.

    A virtual alias expands to its targets, each followed by that target's fallbacks.
    """
    if requested in policy.models:
        heads = [requested]
    elif requested in policy.virtual_models:
        vm = policy.virtual_models[requested]
        # a semantic or routed model's choice is the encoder's; without one: its default, or
        # a routed model's candidates from the dearest (the safest answer when nothing predicts)
        if isinstance(vm, AliasModel):
            heads = list(vm.targets)
        elif isinstance(vm, RoutedModel):
            heads = sorted(vm.routes(), key=lambda m: -_price(policy, m))
        elif isinstance(vm, CascadeModel):
            return candidates(policy, vm.open)
        else:
            heads = [vm.default]
    else:
        raise ModelNotFound(f"The model '{requested}' does not exist", param="model")
    chain: list[str] = []
    for head in heads:
        for name in (head, *policy.models[head].fallbacks):
            if name not in chain:
                chain.append(name)
    if policy.fallback_model is not None and policy.fallback_model not in chain:
        chain.append(policy.fallback_model)
    return chain
