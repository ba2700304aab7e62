"""What the affinity benchmark predicts before it sends anything (``benchmarks/affinity.py``): each prompt's
replica by consistent hashing, the prefix reuse that assignment allows, and the odds of a template's
rows split across replicas."""

from __future__ import annotations

import random
import statistics
from typing import Any

from backends.prefix import reuse_in_order
from backends.replicas import ReplicaSet, ReplicaState
from benchmarks.procs import HOST


def _per_template(rows: list[dict[str, Any]], tokens: list[tuple[int, ...]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r, t in zip(rows, tokens, strict=True):
        row = out.setdefault(r["group"], {"n": 0, "prompt_tokens": 0})
        row["n"] += 1
        row["prompt_tokens"] += len(t)
    return out


def assign(keys: list[str], bases: list[str], chars: int) -> list[int]:
    """The replica (index into ``bases``) of each request, in arrival order, as the gateway picks
    it: rendezvous hashing of the key with ``chars`` > 0, else round robin (in arrival order)."""
    rs = ReplicaSet([ReplicaState(b, None) for b in bases], "round_robin", 0.0)
    index = {b: i for i, b in enumerate(bases)}
    out = []
    for k in keys:
        got = rs.pick(set(), k if chars else None)
        assert got is not None, "an online request always gets a replica"
        out.append(index[got.api_base])
    return out


def predicted_reuse(tokens: list[tuple[int, ...]], where: list[int], replicas: int) -> float:
    """Reuse of one-slot caches (each replica keeps its previous prompt) for this assignment."""
    total = sum(map(len, tokens))
    shared = 0.0
    for r in range(replicas):
        mine = [t for t, w in zip(tokens, where, strict=True) if w == r]
        shared += reuse_in_order(mine) * sum(map(len, mine))
    return shared / total if total else 0.0


def split_odds(keys: list[str], tokens: list[tuple[int, ...]], draws: int, seed: int) -> dict[str, Any]:
    """Over ``draws`` random pairs of replica addresses: how the batch's affinity keys split.
    ``busier_share``: the busier replica's share of requests (and of prompt tokens)."""
    rng = random.Random(seed)
    uniq = sorted(set(keys))
    n_by = dict.fromkeys(uniq, 0)
    tok_by = dict.fromkeys(uniq, 0)
    for k, t in zip(keys, tokens, strict=True):
        n_by[k] += 1
        tok_by[k] += len(t)
    total_n, total_t = len(keys), sum(tok_by.values())
    req_shares, tok_shares = [], []
    for _ in range(draws):
        a, b = rng.sample(range(1024, 65536), 2)
        where = assign(uniq, [f"http://{HOST}:{a}/v1", f"http://{HOST}:{b}/v1"], 1)
        n0 = sum(n_by[k] for k, w in zip(uniq, where, strict=True) if w == 0)
        t0 = sum(tok_by[k] for k, w in zip(uniq, where, strict=True) if w == 0)
        req_shares.append(max(n0, total_n - n0) / total_n)
        tok_shares.append(max(t0, total_t - t0) / total_t)
    return {
        "draws": draws,
        "keys": len(uniq),
        "busier_share_requests_mean": statistics.fmean(req_shares),
        "busier_share_tokens_mean": statistics.fmean(tok_shares),
        "p_all_on_one": sum(s == 1.0 for s in req_shares) / draws,
        "p_busier_over_75pct_requests": sum(s > 0.75 for s in req_shares) / draws,
    }
