"""The learned router end to end: quality heads trained by the real encoder on a small labels file
(a cheap model right on easy prompts only, a dear one right on both), served by a real uvicorn as a
routed virtual model; headers, log event, fallback, `triage calibrate --router` and `triage route`."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from classifiers.calibration import auroc
from classifiers.training.router_training import LabelsProblem, labels_for, train_router
from classifiers.training.train_all import embedding_cache
from gateway.cli import app as cli
from policies import loader
from policies.routed import candidate_costs
from policies.schema import RoutedModel
from tests.conftest import HEADS, Gateway

EASY = [
    "What is {a} plus {b}?",
    "Say hello to {name}.",
    "What colour is a ripe banana, {name}?",
    "Spell the word '{word}' backwards.",
    "Is {a} bigger than {b}?",
    "Write the number {a} in words.",
]
HARD = [
    "Derive the {topic} for a relativistic particle in a curved spacetime with torsion, and prove uniqueness.",
    "Prove that every {topic} on a compact Riemannian manifold admits a harmonic representative.",
    "Explain the renormalisation-group flow of the {topic} near the Wilson-Fisher fixed point in 4-e dims.",
    "Construct a counterexample to the {topic} conjecture for non-Noetherian rings and justify each step.",
]
NAMES = ["Ann", "Bob", "Chen", "Dana", "Eli", "Fay", "Gus", "Hiro"]
WORDS = ["apple", "river", "stone", "cloud", "table", "garden"]
TOPICS = [
    "Hamiltonian",
    "cohomology class",
    "quartic coupling",
    "spectral sequence",
    "Lagrangian density",
    "Killing vector field",
    "Chern character",
    "beta function",
]


def toy_rows(n: int, split: str, seed: int, columns: tuple[str, str] = ("cheap", "dear")) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        easy = i % 2 == 0
        template = rng.choice(EASY if easy else HARD)
        text = template.format(
            a=rng.randint(2, 99),
            b=rng.randint(2, 99),
            name=rng.choice(NAMES),
            word=rng.choice(WORDS),
            topic=rng.choice(TOPICS),
        )
        cheap = rng.random() < (0.95 if easy else 0.05)
        dear = rng.random() < 0.95
        rows.append(
            {
                "id": f"toy-{split}-{i}",
                "source": "toy",
                "question_id": None,
                "split": split,
                "category": "easy" if easy else "hard",
                "prompt": text,
                "correct": {columns[0]: cheap, columns[1]: dear},
            }
        )
    return rows


POLICY = """version: 1
classifier:
  data_dir: {data}
  artifacts: {heads}
  heads: {head_list}
backends:
  echo: {{type: scripted, echo: true}}
  down: {{type: scripted, fail_first: 1000000}}
models:
  cheap: {{backend: {cheap_backend}, upstream: cheap-1b, prices: {{input_per_mtok: 0.1, output_per_mtok: 0.1}}}}
  dear: {{backend: echo, upstream: dear-400b, prices: {{input_per_mtok: 10, output_per_mtok: 30}}}}
  backup: {{backend: echo, upstream: backup-8b}}
virtual_models:
  pick:
    type: routed
    labels: model_labels/toy
    rule: margin
    knob: 0.2
    candidates: [{{model: cheap}}, {{model: dear}}]
fallback_model: backup
"""


def toy_data(data: Path, dev: int, test: int, seed: int) -> Path:
    """``data`` holding model_labels/toy.jsonl: ``dev`` and ``test`` rows of :func:`toy_rows`."""
    (data / "model_labels").mkdir()
    rows = toy_rows(dev, "dev", seed) + toy_rows(test, "test", seed + 1)
    (data / "model_labels" / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


@pytest.fixture(scope="module")
def toy(trained_heads: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A data dir holding model_labels/toy.jsonl, and the heads' folder with the quality head trained."""
    data = toy_data(tmp_path_factory.mktemp("toy-data"), 240, 80, 1)
    pol = loader.parse(policy(data, trained_heads))
    vm = pol.virtual_models["pick"]
    assert isinstance(vm, RoutedModel) and pol.classifier is not None
    cache = embedding_cache(pol.classifier, threads=2, suffix="-test")
    result = train_router(pol, "pick", vm, data, cache.embed, trained_heads)
    assert result.fitted_on == "dev" and result.test_rows == 80
    # the easy/hard split is learnt: every easy test prompt ranks above every hard one for the cheap
    # model (labels are 5% noisy, so AUROC against them is bounded near 0.95)
    test = labels_for(vm, data).split("test")
    p_cheap = result.head.proba(cache.embed(test.texts))[:, 0]
    easy = np.array([c == "easy" for c in test.categories])
    assert auroc(p_cheap, easy) > 0.97, auroc(p_cheap, easy)
    assert result.test_auroc["cheap"] > 0.8, result.test_auroc
    return data, trained_heads


def policy(data: Path, heads: Path, cheap_backend: str = "echo") -> str:
    return POLICY.format(data=data, heads=heads, head_list=json.dumps(HEADS), cheap_backend=cheap_backend)


def ask(gw: Gateway, prompt: str) -> tuple[dict, dict]:
    raw = gw.client().chat.completions.with_raw_response.create(
        model="pick", messages=[{"role": "user", "content": prompt}], max_tokens=4
    )
    return dict(raw.headers), raw.parse().model_dump()


def test_easy_prompts_go_to_the_cheap_model_and_hard_ones_to_the_dear(
    gateway: Callable[..., Gateway], toy: tuple[Path, Path]
) -> None:
    gw = gateway(policy(*toy))
    headers, answer = ask(gw, "What is 17 plus 25?")
    assert headers["x-triage-model"] == "cheap", headers
    assert headers["x-triage-route"] == "quality"
    assert headers["x-triage-reasoning"] == "engine"  # the candidate leaves reasoning to the engine
    chosen = dict(part.split("=") for part in headers["x-triage-quality"].split())
    assert float(chosen["chosen"]) > 0.7 and float(chosen["strongest"]) > 0.7
    assert float(headers["x-triage-expected-cost"]) < 1e-4
    assert json.loads(answer["choices"][0]["message"]["content"])["model"] == "cheap-1b"
    headers, _ = ask(
        gw,
        "Prove that every Chern character on a compact Riemannian manifold admits a harmonic "
        "representative, and derive the Hamiltonian of the flow.",
    )
    assert headers["x-triage-model"] == "dear", headers
    chosen = dict(part.split("=") for part in headers["x-triage-quality"].split())
    assert float(chosen["chosen"]) == float(chosen["best"]) > 0.7


def test_a_failed_choice_falls_back_and_says_so(gateway: Callable[..., Gateway], toy: tuple[Path, Path]) -> None:
    gw = gateway(policy(*toy, cheap_backend="down"))
    headers, answer = ask(gw, "What is 3 plus 4?")
    assert headers["x-triage-model"] == "backup" and headers["x-triage-fallback-from"] == "cheap", headers
    assert json.loads(answer["choices"][0]["message"]["content"])["model"] == "backup-8b"


def test_a_labels_file_without_the_candidate_is_a_clear_error(toy: tuple[Path, Path]) -> None:
    data, heads = toy
    pol = loader.parse(
        policy(data, heads)
        .replace("[{model: cheap}, {model: dear}]", "[{model: cheap}, {model: backup}]")
        .replace("upstream: backup-8b}", "upstream: backup-8b, prices: {input_per_mtok: 1}}")
    )
    vm = pol.virtual_models["pick"]
    assert isinstance(vm, RoutedModel)
    with pytest.raises(LabelsProblem, match="no column backup"):
        labels_for(vm, data)


def test_calibrate_writes_a_patch_that_holds_on_test_rows(toy: tuple[Path, Path], tmp_path: Path) -> None:
    data, heads = toy
    path = tmp_path / "routed.yaml"
    path.write_text(policy(data, heads))
    patch = tmp_path / "patch.yaml"
    out = CliRunner().invoke(
        cli,
        ["calibrate", "--policy", str(path), "--router", "pick", "--target", "strong_share=0.5", "--patch", str(patch)],
    )
    assert out.exit_code == 0, out.output
    knob = float(patch.read_text().split("knob:")[1])
    # the patched knob, applied to the test rows by the served head, holds the target
    pol = loader.parse(policy(data, heads).replace("knob: 0.2", f"knob: {knob}"))
    vm = pol.virtual_models["pick"]
    assert isinstance(vm, RoutedModel) and pol.classifier is not None
    from classifiers.quality import QualityHead
    from eval.router_run import input_tokens

    test = labels_for(vm, data).split("test")
    head = QualityHead.load(heads, "quality-pick")
    cache = embedding_cache(pol.classifier, threads=2, suffix="-test")
    q = head.proba(cache.embed(test.texts))
    from policies.routed import outcome

    got = outcome(q, candidate_costs(pol, vm, input_tokens(test.texts)), vm.rule, vm.knob, 1, test.correct)
    assert got.strong_share <= 0.5 + 0.1, got
    assert got.accuracy >= 0.85, got  # the dear model where it matters: near its 0.95


def test_route_shows_every_candidates_prediction(toy: tuple[Path, Path], tmp_path: Path) -> None:
    data, heads = toy
    path = tmp_path / "routed.yaml"
    path.write_text(policy(data, heads))
    out = CliRunner().invoke(cli, ["route", "What is 2 plus 2?", "--policy", str(path), "--model", "pick", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    preds = {c["candidate"]: c for c in doc["decision"]["candidates"]}
    assert set(preds) == {"cheap", "dear"}
    assert doc["decision"]["model"] == "cheap" and doc["decision"]["reason"] == "quality"
    assert all(0 <= c["quality"] <= 1 and c["expected_cost"] > 0 for c in preds.values())
    assert np.isclose(preds["cheap"]["quality"], doc["decision"]["quality"])


THINKING = """version: 1
classifier:
  data_dir: {data}
  artifacts: {heads}
  heads: {head_list}
backends:
  echo: {{type: scripted, echo: true}}
models:
  qwen: {{backend: echo, upstream: qwen3-8b, family: qwen3, prices: {{input_per_mtok: 0.2, output_per_mtok: 0.2}}}}
virtual_models:
  think:
    type: routed
    labels: model_labels/toy_reasoning
    rule: margin
    knob: 0.2
    output_tokens: 16
    candidates:
      - {{model: qwen, reasoning: "off", labels_as: direct}}
      - {{model: qwen, reasoning: "on", labels_as: cot, reasoning_tokens: 300}}
  auto:
    type: semantic
    default: qwen
    reasoning: {{mode: router, router: think}}
"""


def test_a_reasoning_router_switches_reasoning_where_it_pays(
    gateway: Callable[..., Gateway], trained_heads: Path, tmp_path: Path
) -> None:
    # direct answers right on easy prompts only, chain of thought right on both
    data = tmp_path / "data"
    (data / "model_labels").mkdir(parents=True)
    rows = toy_rows(240, "dev", 3, ("direct", "cot")) + toy_rows(40, "test", 4, ("direct", "cot"))
    (data / "model_labels" / "toy_reasoning.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = THINKING.format(data=data, heads=trained_heads, head_list=json.dumps(HEADS))
    pol = loader.parse(text)
    vm = pol.virtual_models["think"]
    assert isinstance(vm, RoutedModel) and pol.classifier is not None
    embed = embedding_cache(pol.classifier, threads=2, suffix="-test").embed
    train_router(pol, "think", vm, data, embed, trained_heads)
    gw = gateway(text)
    for prompt, on in (
        ("What is 12 plus 30?", False),
        ("Prove that every spectral sequence on a compact Riemannian manifold admits a harmonic representative.", True),
    ):
        raw = gw.client().chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": prompt}], max_tokens=4
        )
        assert raw.headers["x-triage-reasoning"] == ("on" if on else "off"), dict(raw.headers)
        assert raw.headers["x-triage-route"] in ("default", "unfamiliar")  # the guard may find it far
        assert "x-triage-quality" in raw.headers
        body = json.loads(raw.parse().choices[0].message.content or "")
        assert body["chat_template_kwargs"] == {"enable_thinking": on}


def test_a_cascade_tier_can_escalate_to_the_learned_router(
    gateway: Callable[..., Gateway], toy: tuple[Path, Path]
) -> None:
    text = (
        policy(*toy).replace("  echo: {type: scripted, echo: true}", '  echo: {type: scripted, text: "B"}')
        + """cascade:
  tiers:
    - {name: pool, type: model, model: pick, logprobs: false, assumed_confidence: 0.8}
"""
    )
    gw = gateway(text)
    with gw.http() as http:
        out = http.post(
            "/v1/decide", json={"question": "What is 3 plus 4?", "type": "choice", "options": ["6", "7", "8"]}
        )
    assert out.status_code == 200, out.text
    doc = out.json()
    assert doc["answer"] == "7" and doc["tier"] == "pool"
    [step] = doc["trace"]
    assert step["model"] == "cheap", step  # the router's choice for an easy question


def test_eval_router_reports_against_the_baselines(toy: tuple[Path, Path], tmp_path: Path) -> None:
    data, heads = toy
    path = tmp_path / "routed.yaml"
    path.write_text(policy(data, heads))
    out = CliRunner().invoke(
        cli,
        [
            "eval",
            "--policy",
            str(path),
            "--router",
            "pick",
            "--out",
            str(tmp_path / "r"),
            "--no-plots",
            "--fail-under",
            "apgr=0.6",
        ],
    )
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "r" / "router-pick.json").read_text())
    assert doc["protocol"] == "dev -> test" and set(doc["singles"]) == {"cheap", "dear"}
    # the easy/hard split is what a router is for: half the rows gain from the dear model, so a
    # perfect order reaches APGR about 0.75 and 95% of the dear model at about half its calls;
    # random routing gives 0.5 and needs about 95% of them
    t = doc["two_model"]
    assert t["apgr"] > 0.65 and t["share_for_95pct_of_strong"] <= 0.6, t
    failing = CliRunner().invoke(
        cli,
        [
            "eval",
            "--policy",
            str(path),
            "--router",
            "pick",
            "--out",
            str(tmp_path / "r"),
            "--no-plots",
            "--fail-under",
            "apgr=0.999",
        ],
    )
    assert failing.exit_code == 1 and "fail-under" in failing.output


def test_a_routed_models_answers_are_shadow_checked_against_its_dearest_candidate(
    gateway: Callable[..., Gateway], toy: tuple[Path, Path]
) -> None:
    """Issue 32 on a routed model: an answer routed to the cheap candidate is asked of the dear one
    in the background; the same text agrees, an unrelated one does not (the encoder reads them)."""
    import hashlib
    import time

    import httpx

    admin, app = "sk-admin-routed", "sk-app-routed"
    text = policy(*toy).replace(
        "  echo: {type: scripted, echo: true}\n",
        "  echo: {type: scripted, echo: true}\n"
        '  says: {type: scripted, text: "The answer is forty-two."}\n'
        '  top: {type: scripted, text: "The answer is forty-two.", '
        'replies: [{contains: "30 plus", text: "Bananas grow in bunches on tall tropical plants."}]}\n',
    )
    text = text.replace("backend: echo, upstream: dear-400b", "backend: top, upstream: dear-400b")
    text = text.replace("backend: echo, upstream: cheap-1b", "backend: says, upstream: cheap-1b")
    text = text.replace(
        "    candidates: [{model: cheap}, {model: dear}]\n",
        "    candidates: [{model: cheap}, {model: dear}]\n    shadow: {sample: 1.0, budget_per_day: 1.0}\n",
    )
    sha = {k: hashlib.sha256(k.encode()).hexdigest() for k in (admin, app)}
    text += "quality: {path: quality.sqlite3, check_every_s: 0.1}\n"
    text += f'keys: [{{name: app, sha256: "{sha[app]}"}}]\naccess: {{admin_key: "{sha[admin]}"}}\n'
    gw = gateway(text.replace("cheap: {backend: echo", "cheap: {backend: says"))
    client = gw.client(app)
    routed = {}
    for prompt in (
        "What is 17 plus 25?",
        "What is 30 plus 12?",
        "Prove that every Chern character admits a harmonic representative.",
    ):
        raw = client.chat.completions.with_raw_response.create(
            model="pick", messages=[{"role": "user", "content": prompt}]
        )
        routed[prompt] = raw.headers["x-triage-model"]
    assert list(routed.values()) == ["cheap", "cheap", "dear"], routed
    deadline = time.monotonic() + 30
    while True:
        rep = httpx.get(f"{gw.base_url}/admin/quality", headers={"authorization": f"Bearer {admin}"}).json()
        est = next((e for e in rep["estimates"] if e["model"] == "pick"), None)
        if est is not None and est["pairs"] == 2 and est["records"] == 3:
            break
        assert time.monotonic() < deadline, rep
        time.sleep(0.1)
    assert est["agreement"] == 0.5 and est["by_tier"]["cheap"]["pairs"] == 2
    assert est["by_tier"]["dear"]["top"] is True and est["top_share"] == pytest.approx(1 / 3)
    assert rep["shadow"] == {"pick/agree": 1, "pick/disagree": 1}


def test_calibrate_with_a_guarantee_certifies_the_knob_or_refuses(toy: tuple[Path, Path], tmp_path: Path) -> None:
    data, heads = toy
    path = tmp_path / "routed.yaml"
    path.write_text(policy(data, heads))
    patch = tmp_path / "patch.yaml"
    args = ["calibrate", "--policy", str(path), "--router", "pick", "--patch", str(patch), "--guarantee", "0.1"]
    out = CliRunner().invoke(cli, [*args, "--target", "of_strong=0.85"])
    assert out.exit_code == 0, out.output
    assert "guarantee: of_strong=0.85 on new traffic like the 240 dev rows with probability >= 0.9" in patch.read_text()
    assert "target of_strong >= 0.85: test" in out.output and "held" in out.output
    strong_share = float(re.search(r"test: knob .*?strong\s+share ([\d.]+)", out.output, re.S)[1])  # type: ignore[index]
    assert strong_share < 0.8, out.output  # the easy half goes to the cheap model
    # 95% of a 0.95 model on 240 rows, within noise of the dear model itself: not certified
    refused = CliRunner().invoke(cli, [*args, "--target", "of_strong=0.999", "--patch", str(tmp_path / "no.yaml")])
    assert refused.exit_code == 1 and "refused" in refused.output and not (tmp_path / "no.yaml").exists()
