"""The fleet simulator (benchmarks/fleet_sim.py): it ends, conserves requests, and the gateway's
prefix rule reuses more than round robin where prompts share a start, at no cost where none do."""

from __future__ import annotations

from benchmarks import fleet_rules, fleet_workloads
from benchmarks.fleet_sim import PROFILES, Sim, oracle_hit_rate, summary

P = PROFILES["h100-llama8b"]


def _run(workload: fleet_workloads.Workload, rule: str, replicas: int = 8, rate: float = 60.0):
    timed, flat = workload.instances(P.block_tokens, rate)
    sim = Sim(P, replicas)
    stats = sim.run(fleet_rules.make(rule), timed, len(flat))
    return sim, flat, stats, summary(stats, sim.poll_s)


def test_every_request_ends_once_and_the_engines_end_empty() -> None:
    w = fleet_workloads.load("multi_turn", 200, seed=1)
    for rule in fleet_rules.RULES:
        sim, flat, stats, s = _run(w, rule)
        assert stats.done == len(flat) == w.requests == s["requests"]
        assert all(q.done >= q.first >= q.arrival >= 0 for q in flat)
        assert all(q.then is None or q.then.arrival >= q.done for q in flat)  # turn 2 after turn 1
        for e in sim.engines:
            assert not e.waiting and not e.prefilling and e.n_decode == 0 and e.ctx == 0
            assert not e.refs and e.private == 0  # every block given back
            assert len(e.lru) <= e.cap
        held = {h for e in sim.engines for h in e.lru}
        assert held == set(sim.holders)  # the KV-events index is the engines' caches


def test_prefix_rule_reuses_more_than_round_robin_on_shared_prefixes() -> None:
    w = fleet_workloads.load("fewshot", 400, seed=2)
    rr = _run(w, "round_robin")[3]
    px = _run(w, "prefix")[3]
    assert px["hit_rate"] > rr["hit_rate"] + 0.05
    _, flat, _, _ = _run(w, "prefix")
    assert px["hit_rate"] <= oracle_hit_rate(flat, 8 * (P.kv_tokens // P.block_tokens), P.block_tokens) + 1e-9


def test_no_shared_prefix_costs_the_prefix_rule_nothing() -> None:
    w = fleet_workloads.load("unique", 1500, seed=3)
    ll = _run(w, "least_load")[3]
    px = _run(w, "prefix")[3]
    assert px["hit_rate"] == ll["hit_rate"] == 0.0
    assert px["ttft_p50_s"] <= ll["ttft_p50_s"] * 1.05
    assert px["ttft_p99_s"] <= ll["ttft_p99_s"] * 1.10  # a p99 of 1,500 requests moves by a few %
    assert abs(px["throughput_tok_s"] / ll["throughput_tok_s"] - 1) < 0.03


def test_a_background_line_waits_for_spare_room() -> None:
    w = fleet_workloads.load("unique", 100, seed=4)
    timed, flat = w.instances(P.block_tokens, 60.0)
    b = fleet_workloads.load("fewshot", 40, seed=5)
    btimed, bflat = b.instances(P.block_tokens, 1.0)
    for k, (_, q) in enumerate(btimed):
        q.rid, q.background = 10_000 + k, True
    sim = Sim(P, 4)
    stats = sim.run(
        fleet_rules.make("prefix"),
        sorted(timed + [(0.0, q) for _, q in btimed], key=lambda x: x[0]),
        len(flat) + len(bflat),
    )
    assert stats.done == len(flat) + len(bflat) and not sim.backlog
    assert len(stats.batch_ttft) == len(bflat)
