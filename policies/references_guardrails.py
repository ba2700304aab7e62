"""The guardrails' cross-references (part of :func:`policies.references.reference_problems`): the
lists of who gets which guardrails name guardrails that exist, and a jailbreak guardrail has the
encoder it reads (the policy's ``classifier``). Keys and teams made at run time (the admin API)
may be named before they exist."""

from __future__ import annotations

from policies.schema import Loc, Policy
from policies.schema_guardrails import JailbreakGuardrail


def guardrail_problems(policy: Policy) -> list[tuple[Loc, str]]:
    spec = policy.guardrails
    if spec is None:
        return []
    problems: list[tuple[Loc, str]] = []
    lists: list[tuple[Loc, list[str]]] = [(("guardrails", "default"), spec.default or [])]
    lists += [(("guardrails", "keys", k), names) for k, names in spec.keys.items()]
    lists += [(("guardrails", "teams", t), names) for t, names in spec.teams.items()]
    for where, names in lists:
        for i, name in enumerate(names):
            if name not in spec.checks:
                problems.append(((*where, i), f"guardrail '{name}' is not defined in guardrails.checks"))
        if len(set(names)) != len(names):
            problems.append((where, "a guardrail is named twice"))
    for name, g in spec.checks.items():
        if isinstance(g, JailbreakGuardrail) and policy.classifier is None:
            problems.append(
                (
                    ("guardrails", "checks", name),
                    "a jailbreak guardrail reads the encoder: the policy needs `classifier`",
                )
            )
    return problems
