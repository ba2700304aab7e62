"""The semantic cache's index and hit rule, and their fitting, on synthetic vectors (no encoder)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eval.cache_fit import Replay, Stream, fit, simulate, total
from policies.semantic_cache import Neighbours, Rule, SemanticIndex


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=-1, keepdims=True)).astype(np.float32)


def test_index_finds_the_nearest_and_other() -> None:
    index = SemanticIndex(dim=3, capacity=10)
    a = index.add(unit(np.array([1.0, 0.0, 0.0])), group=1)
    index.add(unit(np.array([1.0, 0.2, 0.0])), group=1)
    index.add(unit(np.array([0.0, 1.0, 0.0])), group=2)
    n = index.nearest(unit(np.array([1.0, 0.05, 0.0])))
    assert n is not None
    assert (n.entry, n.group, n.agree, n.k, n.size) == (a, 1, 2, 3, 3)
    assert n.similarity == pytest.approx(float(unit(np.array([1.0, 0.05, 0.0]))[0]), abs=1e-6)
    assert n.other == pytest.approx(float(unit(np.array([1.0, 0.05, 0.0]))[1]), abs=1e-6)


def test_other_is_minus_one_with_one_group_and_empty_is_none() -> None:
    index = SemanticIndex(dim=2, capacity=4)
    assert index.nearest(unit(np.array([1.0, 0.0]))) is None
    index.add(unit(np.array([1.0, 0.0])), group=7)
    n = index.nearest(unit(np.array([0.0, 1.0])))
    assert n is not None and n.other == -1.0 and n.group == 7


def test_past_capacity_the_oldest_is_evicted_and_removed_entries_are_not_found() -> None:
    index = SemanticIndex(dim=2, capacity=2)
    first = index.add(unit(np.array([1.0, 0.0])), group=1)
    second = index.add(unit(np.array([0.0, 1.0])), group=2)
    third = index.add(unit(np.array([-1.0, 0.0])), group=3)
    assert len(index) == 2
    n = index.nearest(unit(np.array([1.0, 0.01])))
    assert n is not None and n.entry != first
    index.remove(second)
    n = index.nearest(unit(np.array([0.0, 1.0])))
    assert n is not None and n.entry == third and n.size == 1


def test_other_beyond_the_k_nearest() -> None:
    index = SemanticIndex(dim=2, capacity=20, k=2)
    for _ in range(5):
        index.add(unit(np.array([1.0, 0.0])), group=1)
    index.add(unit(np.array([0.0, 1.0])), group=2)
    n = index.nearest(unit(np.array([1.0, 0.1])))
    assert n is not None and n.agree == 2 and n.other == pytest.approx(float(unit(np.array([1.0, 0.1]))[1]), abs=1e-6)


@pytest.mark.parametrize("rule", [Rule(), Rule("margin", 0.9, 0.04), Rule("vote", 0.85, 0.02, 6)])
def test_a_rule_round_trips(rule: Rule) -> None:
    assert Rule.from_dict(rule.as_dict()) == rule


def test_rules_read_their_fields() -> None:
    n = Neighbours(entry=0, similarity=0.95, group=1, other=0.93, agree=3, k=8, size=10)
    assert Rule("global", 0.9).accepts(n)
    assert not Rule("margin", 0.9, 0.05).accepts(n)
    assert Rule("margin", 0.9, 0.01).accepts(n)
    assert not Rule("vote", 0.9, 0.01, 4).accepts(n)
    with pytest.raises(ValueError):
        Rule("nearest")
    with pytest.raises(ValueError):
        Rule.from_dict({"kind": "global", "threshold": 0.9})


def clusters(seed: int, n: int) -> Stream:
    """Pairs of groups whose centres are close (cosine 0.88); a group's members are spread around
    its centre, so a global threshold must stay above the pairs' confusion while a margin rule
    sees which of the pair is nearer."""
    rng = np.random.default_rng(seed)
    dim, pairs = 64, 10
    base = unit(rng.standard_normal((pairs, dim)))
    side = unit(rng.standard_normal((pairs, dim)))
    centres = unit(np.concatenate([base + 0.25 * side, base - 0.25 * side]))
    groups = rng.integers(0, 2 * pairs, n)
    vectors = unit(centres[groups] + 0.08 * rng.standard_normal((n, dim)))
    return Stream(f"synthetic/{seed}", vectors, groups.astype(np.int64))


def test_the_replay_is_the_index() -> None:
    s = clusters(1, 400)
    for rule in (Rule("global", 0.9), Rule("margin", 0.85, 0.03), Rule("vote", 0.85, 0.0, 6)):
        assert Replay(s).run(rule) == simulate(rule, s)


def test_fitting_keeps_the_budget_and_the_margin_rule_beats_the_global_one() -> None:
    tuning = [Replay(clusters(2, 800))]
    budget = 0.02
    g = fit("global", tuning, budget, confidence=0.0)
    m = fit("margin", tuning, budget, confidence=0.0)
    assert g.tuning.hits > 0 and g.tuning.false_hit_rate <= budget
    assert m.tuning.false_hit_rate <= budget
    assert m.tuning.hits > 2 * g.tuning.hits
    safe = fit("margin", tuning, budget, confidence=0.95)
    assert safe.bound <= budget and safe.tuning.hits <= m.tuning.hits
    test = total(r.run(m.rule) for r in [Replay(clusters(3, 800))])
    assert test.hits > 0


def test_the_index_grows_as_entries_come_and_stays_within_its_capacity() -> None:
    rng = np.random.default_rng(0)
    index = SemanticIndex(8, capacity=100)
    assert index._vectors.shape[0] == 16  # a context with few entries holds little
    vectors = rng.normal(size=(150, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = [index.add(v, i) for i, v in enumerate(vectors)]
    assert len(index) == 100 and index._vectors.shape[0] == 100
    assert ids[0] not in index and ids[-1] in index  # the oldest left first
    found = index.nearest(vectors[-1])
    assert found is not None and found.entry == ids[-1] and abs(found.similarity - 1) < 1e-5


def test_triage_cache_fit_prints_a_rule_the_policy_reads(tmp_path: Path, trained_heads: Path) -> None:
    """The CLI end to end on a small sample of the three intent sets (the served encoder embeds)."""
    import gzip
    import json

    from typer.testing import CliRunner

    from eval.cache_fit import SETS, TUNING, read_rows, seeded
    from gateway.cli import app
    from policies import loader
    from tests.conftest import SHARED_DATA

    (tmp_path / "data" / "intent").mkdir(parents=True)
    for name, file in SETS.items():
        rows = read_rows(SHARED_DATA, name)
        labels = sorted({r["label"] for r in rows})[:8]  # a few intents, many rows each: hits happen
        kept = [r for r in seeded(rows) if r["label"] in labels and r["split"] == TUNING[name]][:160]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        path = tmp_path / "data" / "intent" / file
        path.write_bytes(gzip.compress(text.encode()) if file.endswith(".gz") else text.encode())
    policy = tmp_path / "p.yaml"
    policy.write_text(
        f"version: 1\nclassifier: {{artifacts: {trained_heads}, heads: [question_type]}}\n"
        "backends: {b: {type: scripted}}\nmodels: {m: {backend: b}}\n"
    )
    out = CliRunner().invoke(
        app, ["cache", "fit", "--policy", str(policy), "--budget", "0.05", "--data", str(tmp_path / "data")]
    )
    assert out.exit_code == 0, out.output
    snippet = out.output.strip().splitlines()[-1]
    assert snippet.startswith("semantic: {false_hit_budget: 0.05, rule: {kind: vote")
    text = policy.read_text() + f"response_cache:\n  {snippet[:-1]}, models: [m]}}\n"
    assert loader.parse(text, "p.yaml", tmp_path).response_cache is not None
