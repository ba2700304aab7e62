"""The policy's cross-references checked after its fields validate: every name a model, virtual
model, tier, rule, shadow check or key refers to exists and fits what refers to it, each problem
with where it stands (``policies.loader`` turns the place into file:line:col)."""

from __future__ import annotations

from policies.references_access import access_problems
from policies.references_guardrails import guardrail_problems
from policies.rollouts import primary_of
from policies.schema import (
    AliasModel,
    CascadeModel,
    ClassifierSpec,
    GGUFProbeBackendSpec,
    GGUFScorerBackendSpec,
    Loc,
    Policy,
    RoutedModel,
    SemanticModel,
    SplitModel,
    VirtualModel,
)
from policies.tiers import EncoderTier, ModelTier, ScorerTier


def reference_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """Every dangling or clashing name in the policy, with where it stands."""
    return [
        *_model_problems(policy),
        *(p for name, vm in policy.virtual_models.items() for p in _virtual_problems(policy, name, vm)),
        *_cascade_problems(policy),
        *_shadow_problems(policy),
        *_cache_problems(policy),
        *_key_problems(policy),
        *access_problems(policy),
        *guardrail_problems(policy),
    ]


def _model_problems(policy: Policy) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    models = policy.models
    for name, spec in models.items():
        if spec.backend not in policy.backends:
            problems.append((("models", name, "backend"), f"backend '{spec.backend}' is not defined"))
        listed: list[tuple[tuple[str | int, ...], str]] = [
            (("fallbacks", i), fb) for i, fb in enumerate(spec.fallbacks)
        ]
        listed += [(("fallbacks_on", why, i), fb) for why, fbs in spec.fallbacks_on.items() for i, fb in enumerate(fbs)]
        for where, fb in listed:
            if fb not in models:
                problems.append((("models", name, *where), f"model '{fb}' is not defined"))
            elif fb == name:
                problems.append((("models", name, *where), "a model cannot fall back to itself"))
    return problems


def _virtual_problems(policy: Policy, name: str, vm: VirtualModel) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    models = policy.models
    if name in models:
        problems.append((("virtual_models", name), f"'{name}' is also a model name"))
    if isinstance(vm, CascadeModel):
        opened = policy.virtual_models.get(vm.open)
        if vm.open not in models and not isinstance(opened, AliasModel | SemanticModel | RoutedModel):
            problems.append(
                (
                    ("virtual_models", name, "open"),
                    f"'{vm.open}' is not a model or an alias/semantic/routed virtual model",
                )
            )
        if policy.cascade is None:
            problems.append((("virtual_models", name), "a cascade model needs a `cascade` section"))
        return problems
    if isinstance(vm, RoutedModel):
        return problems + _routed_problems(policy, name, vm)
    if isinstance(vm, SplitModel):
        for target in vm.targets:
            other = policy.virtual_models.get(target)
            if target not in models and not isinstance(other, AliasModel | SemanticModel | RoutedModel):
                problems.append(
                    (
                        ("virtual_models", name, "targets", target),
                        f"'{target}' is not a model or an alias/semantic/routed virtual model",
                    )
                )
        return problems
    if isinstance(vm, AliasModel):
        refs: list[tuple[Loc, str]] = [(("targets", i), t) for i, t in enumerate(vm.targets)]
    else:
        refs = [
            (("default",), vm.default),
            *((("rules", i, "model"), r.model) for i, r in enumerate(vm.rules)),
            *((("categories", c), m) for c, m in vm.categories.items()),
            *(((f,), m) for f in ("escalate_to", "unfamiliar", "injection") if (m := getattr(vm, f)) is not None),
        ]
        if policy.classifier is None:
            problems.append((("virtual_models", name), "a semantic model needs a `classifier` section"))
        else:
            problems.extend(_rule_head_problems(name, vm, policy.classifier))
        problems.extend(_reasoning_router_problems(policy, name, vm))
    for where, target in refs:
        if target not in models:
            problems.append((("virtual_models", name, *where), f"model '{target}' is not defined"))
    return problems


def _cache_problems(policy: Policy) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    semantic = policy.response_cache.semantic if policy.response_cache is not None else None
    for i, name in enumerate(semantic.models if semantic is not None else []):
        if name not in policy.models and name not in policy.virtual_models:
            problems.append((("response_cache", "semantic", "models", i), f"model '{name}' is not defined"))
    if semantic is not None and policy.classifier is None:
        problems.append((("response_cache", "semantic"), "a semantic cache needs a `classifier` section (its encoder)"))
    return problems


def _key_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """Operator keys that name no key, the fallback model, keys' names used twice, keys' models."""
    problems: list[tuple[Loc, str]] = []
    names = {key.name for key in policy.keys}
    for i, name in enumerate(policy.access.operator_keys):
        if name not in names:
            problems.append((("access", "operator_keys", i), f"key '{name}' is not defined in keys"))
    if policy.fallback_model is not None and policy.fallback_model not in policy.models:
        problems.append((("fallback_model",), f"model '{policy.fallback_model}' is not defined"))
    listed = [k.name for k in policy.keys]
    public = {*policy.models, *policy.virtual_models}
    for i, key in enumerate(policy.keys):
        if listed.index(key.name) != i:
            problems.append((("keys", i, "name"), f"key name '{key.name}' is used twice"))
        for j, name in enumerate(key.models or []):
            if name not in public:
                problems.append((("keys", i, "models", j), f"model '{name}' is not defined"))
    return problems


def _reasoning_router_problems(policy: Policy, name: str, vm: SemanticModel) -> list[tuple[Loc, str]]:
    """``reasoning: {mode: router}`` names a routed model that chooses between reasoning off and on."""
    if vm.reasoning.router is None:
        return []
    where: Loc = ("virtual_models", name, "reasoning", "router")
    target = policy.virtual_models.get(vm.reasoning.router)
    if not isinstance(target, RoutedModel):
        return [(where, f"'{vm.reasoning.router}' is not a routed virtual model")]
    modes = {c.reasoning for c in target.candidates}
    if modes != {"on", "off"}:
        return [
            (
                where,
                f"routed model '{vm.reasoning.router}' must have candidates with reasoning off and on, "
                f"and only those (has: {', '.join(sorted(str(m) for m in modes))})",
            )
        ]
    return []


def _routed_problems(policy: Policy, name: str, vm: RoutedModel) -> list[tuple[Loc, str]]:
    """Candidates must be models with prices (the choice weighs cost), each once per reasoning mode;
    a probe reads with a ``gguf_probe`` backend."""
    problems: list[tuple[Loc, str]] = []
    if policy.classifier is None:
        problems.append((("virtual_models", name), "a routed model needs a `classifier` section"))
    seen: set[tuple[str, str | None]] = set()
    for i, c in enumerate(vm.candidates):
        where: Loc = ("virtual_models", name, "candidates", i)
        spec = policy.models.get(c.model)
        if spec is None:
            problems.append(((*where, "model"), f"model '{c.model}' is not defined"))
            continue
        p = spec.prices
        if p.input_per_mtok == p.output_per_mtok == p.per_call == 0:
            problems.append(
                (
                    (*where, "model"),
                    f"model '{c.model}' has no prices: the router weighs cost (set models.{c.model}.prices)",
                )
            )
        if (c.model, c.reasoning) in seen:
            problems.append((where, f"candidate '{c.model}' (reasoning {c.reasoning or 'default'}) is listed twice"))
        seen.add((c.model, c.reasoning))
    if vm.probe is not None:
        at: Loc = ("virtual_models", name, "probe", "backend")
        backend = policy.backends.get(vm.probe.backend)
        if backend is None:
            problems.append((at, f"backend '{vm.probe.backend}' is not defined"))
        elif not isinstance(backend, GGUFProbeBackendSpec):
            problems.append((at, f"backend '{vm.probe.backend}' is a {backend.type} backend, not a gguf_probe one"))
        twin = f"{name}-probe"  # its second head's file is named as that model's first head
        if isinstance(policy.virtual_models.get(twin), RoutedModel):
            problems.append(
                (
                    ("virtual_models", name, "probe"),
                    f"routed model '{twin}' would share its head's file with this probe's head: rename one",
                )
            )
    return problems


def _rule_head_problems(name: str, vm: SemanticModel, classifier: ClassifierSpec) -> list[tuple[Loc, str]]:
    """A rule must read a head the classifier computes (not ``options`` or ``injection``: the guard
    takes the latter's routes). Its labels are checked against the trained head when it loads."""
    problems: list[tuple[Loc, str]] = []
    routable = [h for h in classifier.heads if h not in ("options", "injection")] + list(classifier.tasks)
    for i, rule in enumerate(vm.rules):
        if rule.head not in routable:
            problems.append(
                (
                    ("virtual_models", name, "rules", i, "head"),
                    f"head '{rule.head}' is not one the classifier computes (has: {', '.join(routable)})",
                )
            )
    if vm.categories and "category" not in classifier.heads:
        problems.append((("virtual_models", name, "categories"), "the classifier has no `category` head"))
    return problems


def _shadow_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """A shadow check needs a top to ask (the cascade's last tier a model tier; a routed model's
    reference one of its candidates) and somewhere to keep its pairs (the `quality` section)."""
    problems: list[tuple[Loc, str]] = []
    shadowed: list[Loc] = []
    cascade = policy.cascade
    if cascade is not None and cascade.shadow is not None:
        shadowed.append(("cascade", "shadow"))
        if len(cascade.tiers) < 2 or not isinstance(cascade.tiers[-1], ModelTier):
            problems.append((("cascade", "shadow"), "shadow checks need two tiers or more, the last a model tier"))
    for name, vm in policy.virtual_models.items():
        if isinstance(vm, RoutedModel) and vm.shadow is not None:
            shadowed.append(("virtual_models", name, "shadow"))
            ref = vm.shadow.reference
            if ref is not None and ref not in vm.routes():
                problems.append(
                    (("virtual_models", name, "shadow", "reference"), f"'{ref}' is not one of the candidates")
                )
        if isinstance(vm, SplitModel):
            problems.extend(_split_watch_problems(name, vm, shadowed))
    problems.extend(_mirror_problems(policy, shadowed))
    if policy.quality is None:
        problems.extend(
            (where, "shadow checks, mirrors and guards need a `quality` section (where the records are kept)")
            for where in shadowed
        )
    return problems


def _split_watch_problems(name: str, vm: SplitModel, watched: list[Loc]) -> list[tuple[Loc, str]]:
    """A split's guard and shadow checks name its own targets; a guard needs a candidate to judge,
    an agreement bound needs the shadow checks that measure it."""
    problems: list[tuple[Loc, str]] = []
    where: Loc = ("virtual_models", name)
    if vm.shadow is not None:
        watched.append((*where, "shadow"))
        if vm.shadow.reference is not None and vm.shadow.reference not in vm.targets:
            problems.append(((*where, "shadow", "reference"), f"'{vm.shadow.reference}' is not one of the targets"))
    guard = vm.guard
    if guard is None:
        return problems
    watched.append((*where, "guard"))
    if len(vm.targets) < 2:
        problems.append(((*where, "guard"), "a guard needs a candidate beside the primary: two targets or more"))
    if guard.primary is not None and guard.primary not in vm.targets:
        problems.append(((*where, "guard", "primary"), f"'{guard.primary}' is not one of the targets"))
    if guard.min_agreement is not None and vm.shadow is None:
        problems.append(((*where, "guard", "min_agreement"), "an agreement bound needs the split's `shadow` checks"))
    ref, primary = vm.shadow.reference if vm.shadow is not None else None, primary_of(vm.targets.items(), guard)
    if ref is not None and ref != primary:
        problems.append(
            ((*where, "shadow", "reference"), f"the shadow's reference must be the guard's primary '{primary}'")
        )
    return problems


def _mirror_problems(policy: Policy, watched: list[Loc]) -> list[tuple[Loc, str]]:
    """A mirror copies a name a request may name to a policy model other than itself."""
    problems: list[tuple[Loc, str]] = []
    for name, mirror in policy.mirrors.items():
        watched.append(("mirrors", name))
        if name not in policy.models and name not in policy.virtual_models:
            problems.append((("mirrors", name), f"model '{name}' is not defined"))
        if mirror.to not in policy.models:
            problems.append((("mirrors", name, "to"), f"'{mirror.to}' is not a model of the policy"))
        elif mirror.to == name:
            problems.append((("mirrors", name, "to"), "a mirror's candidate is another model than the one mirrored"))
    return problems


def _cascade_problems(policy: Policy) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    for name, spec in policy.models.items():
        backend = policy.backends.get(spec.backend)
        if isinstance(backend, GGUFScorerBackendSpec):
            problems.append((("models", name, "backend"), f"backend '{spec.backend}' is a scorer: it cannot generate"))
        if isinstance(backend, GGUFProbeBackendSpec):
            problems.append((("models", name, "backend"), f"backend '{spec.backend}' is a probe: it cannot generate"))
    if policy.cascade is None:
        return problems
    if policy.cascade.memory is not None and policy.classifier is None:
        problems.append(
            (("cascade", "memory"), "the memory is keyed by the encoder's embedding: it needs a `classifier`")
        )
    names: list[str] = []
    for i, tier in enumerate(policy.cascade.tiers):
        where: Loc = ("cascade", "tiers", i)
        if tier.name in names:
            problems.append(((*where, "name"), f"tier name '{tier.name}' is used twice"))
        names.append(tier.name)
        if isinstance(tier, EncoderTier) and policy.classifier is None:
            problems.append((where, "an encoder tier needs a `classifier` section"))
        if isinstance(tier, EncoderTier) and policy.classifier is not None:
            for task in tier.task_thresholds:
                if task not in policy.classifier.tasks:
                    problems.append(((*where, "task_thresholds", task), f"task '{task}' is not in classifier.tasks"))
        if isinstance(tier, ScorerTier) and not isinstance(policy.backends.get(tier.backend), GGUFScorerBackendSpec):
            problems.append(((*where, "backend"), f"backend '{tier.backend}' is not a gguf_scorer backend"))
        routed = isinstance(policy.virtual_models.get(getattr(tier, "model", "")), RoutedModel)
        if isinstance(tier, ModelTier) and tier.model not in policy.models and not routed:
            problems.append(
                ((*where, "model"), f"model '{tier.model}' is not defined (a model or a routed virtual model)")
            )
    return problems
