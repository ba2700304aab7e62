"""What a policy cannot do when served by several processes. Pure: reads the policy only."""

from __future__ import annotations

from policies.schema import Policy


def per_process_problems(policy: Policy, workers: int) -> list[str]:
    """What the policy cannot do with ``workers`` processes on a memory state store, which each worker
    keeps for itself: keys with limits (every worker would let the whole limit through), and the
    admin API (a key made through one worker would be unknown to the others)."""
    if workers <= 1 or policy.state.store != "memory":
        return []
    problems = []
    fix = (
        "Set state.store: redis (state: {store: redis, url: ...}), which every worker shares, or serve with --workers 1"
    )
    limited = [k.name for k in policy.keys if any(v is not None for v in k.limits.model_dump().values())]
    if limited:
        problems.append(
            f"--workers {workers}: keys {', '.join(limited)} have limits (rpm, tpm or budgets), and state.store is "
            f"memory, which each worker process keeps for itself: every worker would let the whole limit through. {fix}"
        )
    if policy.access.admin_key is not None:
        problems.append(
            f"--workers {workers}: access.admin_key turns on /admin, whose keys live in the state store, and "
            f"state.store is memory, which each worker process keeps for itself: a key made through one worker "
            f"would be refused by the others. {fix}"
        )
    return problems
