"""The eval's run in-process (what `triage eval`, `triage calibrate` and `triage train`'s learned
gates print and write): rows read, a live tier's answers cached, thresholds fitted to a target, the
report and the patch, and a learned gate saved. The live tier is a scripted one, handed in as the
CLI hands in the gateway's runtime."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eval import cascade_report
from eval.cascade_run import Rows, RunError, Tiers, load_rows
from eval.gate_fit import fit_gates, learned
from eval.tier_outputs import Row
from eval.tier_runs import Compute
from policies import loader
from policies.cascade import TierAnswer
from policies.tiers import ModelTier

POLICY = """version: 1
backends:
  echo: {type: scripted, echo: true}
models:
  m: {backend: echo}
  n: {backend: echo}
cascade:
  artifacts: %s
  tiers:
    - {name: first, type: model, model: m, gate: %s}
    - {name: last, type: model, model: n}
"""


def write_rows(path: Path, n: int = 120) -> None:
    lines = [
        {
            "id": f"q{i}",
            "source": "toy",
            "type": "yes_no",
            "question": f"Is {i} even?",
            "answer": "yes" if i % 2 == 0 else "no",
            "split": "dev" if i < n * 2 // 3 else "test",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(doc) + "\n" for doc in lines) + "not json\n")


class Scripted:
    """Live tiers without a runtime: ``first`` is right on multiples of 4 and 50/50 elsewhere
    (sure of neither), ``last`` always right and sure."""

    closed = 0

    def __init__(self, *_: object) -> None:
        pass

    def compute(self, tier: ModelTier) -> Compute:
        def run(row: Row) -> TierAnswer:
            i, gold = int(row.id[1:]), 0 if row.answer == "yes" else 1
            if tier.name == "first" and i % 4:
                return TierAnswer(scores=(math.log(0.5), math.log(0.5)))
            p = 0.8 if tier.name == "first" else 0.99
            return TierAnswer(scores=tuple(math.log(p if j == gold else 1 - p) for j in range(2)))

        return run

    def close(self) -> None:
        Scripted.closed += 1


def setup(tmp_path: Path, gate: str = "confidence") -> tuple[Path, Path]:
    policy, data = tmp_path / "p.yaml", tmp_path / "toy.jsonl"
    policy.write_text(POLICY % (tmp_path / "judges", gate))
    write_rows(data)
    return policy, data


def test_rows_are_read_with_bad_lines_said_once_and_a_missing_file_stops_the_run(tmp_path: Path) -> None:
    policy, data = setup(tmp_path)
    pol = loader.load(policy)
    rows = load_rows(pol, policy, [data], 300, 10)
    assert (len(rows.dev), len(rows.test)) == (80, 10)
    assert rows.problems == ["toy.jsonl:121: not JSON (Expecting value)"]
    with pytest.raises(RunError, match="no such file") as missing:
        load_rows(pol, policy, [tmp_path / "nope.jsonl"], 300, 300)
    assert missing.value.code == 2
    with pytest.raises(RunError, match="--task intents: not a task of the policy's classifier"):
        load_rows(pol, policy, [data], 300, 300, ["intents"])


def test_a_run_fits_to_a_target_reports_and_writes_the_patch(tmp_path: Path) -> None:
    policy, data = setup(tmp_path)
    pol = loader.load(policy)
    rows = load_rows(pol, policy, [data], 300, 300)
    with pytest.raises(RunError, match="--tiers: no tier named nope"):
        Tiers(pol, tmp_path, tmp_path / "out", ["nope"], live=Scripted).specs(rows)
    with pytest.raises(RunError, match="no live runtime"):
        Tiers(pol, tmp_path, tmp_path / "out").specs(rows)
    closed = Scripted.closed
    specs = Tiers(pol, tmp_path, tmp_path / "out", live=Scripted).specs(rows)
    assert Scripted.closed == closed + 1  # one runtime for both tiers, closed after them
    assert sorted(p.name for p in (tmp_path / "out" / "cache").iterdir()) == ["model-m-m.jsonl", "model-n-n.jsonl"]
    goal = cascade_report.parse_target("escalation=0.8")
    assert cascade_report.fit(specs, rows.dev, 0.0, goal, None) is None
    measured = cascade_report.measure(specs, rows.test)
    [report] = measured.sets
    assert report.n == 40 and report.alone["last"] == 1.0 and set(measured.pooled) == {"all"}
    check = cascade_report.check_target(goal, [], measured.sets)
    assert check.goal == ("escalation", 0.8) and check.held == (check.test <= 0.82)
    patch = cascade_report.policy_patch(policy, specs, measured.sets, len(rows.dev))
    assert patch.startswith("# triage eval --patch: fitted on 80 dev rows") and "    - name: first\n" in patch
    inputs = cascade_report.Inputs(policy, [data], [], (300, 300), rows.problems)
    doc = cascade_report.report_doc(inputs, specs, measured, None)
    cascade_report.write(tmp_path / "out", doc, measured.sets, specs, rows.test, plots=False)
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["tiers"][0]["name"] == "first" and written["skipped_lines"] == rows.problems
    assert "| toy | yes_no | 40 |" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    ("spec", "says"),
    [("speed=3", "expected accuracy=X"), ("accuracy=2", "within [0, 1]"), ("cost=-1", "a cost is >= 0")],
)
def test_a_bad_target_says_what_a_target_is(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        cascade_report.parse_target(spec)


def test_a_learned_gate_is_fitted_at_the_policys_temperatures_and_saved(tmp_path: Path) -> None:
    policy, data = setup(tmp_path, gate="learned")
    pol = loader.load(policy)
    assert learned(pol) == [0]
    loaded = load_rows(pol, policy, [data], 300, 0)
    assert loaded.test == []
    [gate] = fit_gates(pol, policy, Rows(loaded.dev, [], []), tmp_path / "out", tmp_path / "judges", live=Scripted)
    assert gate.tier == "first" and gate.saved == tmp_path / "judges" / "confidence-first.json"
    assert gate.saved.is_file() and gate.fit["rows"] == 80
