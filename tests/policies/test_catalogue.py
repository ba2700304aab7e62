"""Prices and context windows from litellm's catalogue (policies/catalogue.py): a provider model
with none in its policy takes the catalogue's; the policy's own always win; an engine you run or a
name the catalogue lacks is left as written; `triage validate --explain` says where each came from."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from gateway.cli import app
from policies import catalogue, loader

POLICY = """version: 1
backends:
  openai: {type: litellm, replicas: [{api_base: "https://api.example.test/v1", api_key: "env:NO_KEY"}]}
  mine: {type: openai, replicas: [{api_base: "http://127.0.0.1:9/v1"}]}
models:
  gpt-4o: {backend: openai}
  priced: {backend: openai, upstream: openai/gpt-4o, prices: {input_per_mtok: 1, output_per_mtok: 2},
           context_length: 4096}
  unknown: {backend: openai, upstream: not-a-real-model-name}
  local: {backend: mine, upstream: gpt-4o}
"""


def test_a_provider_model_takes_the_catalogues_figures_and_the_policy_wins() -> None:
    name, entry = catalogue.lookup("gpt-4o") or ("", {})
    assert name == "gpt-4o" and entry["input_cost_per_token"] > 0  # the pinned litellm's own figure
    policy = loader.parse(POLICY)
    filled = policy.models["gpt-4o"]
    assert filled.prices.input_per_mtok == entry["input_cost_per_token"] * 1e6
    assert filled.prices.output_per_mtok == entry["output_cost_per_token"] * 1e6
    assert filled.context_length == entry["max_input_tokens"]
    assert (policy.models["priced"].prices.input_per_mtok, policy.models["priced"].context_length) == (1, 4096)
    assert policy.models["unknown"].prices.input_per_mtok == 0 and policy.models["unknown"].context_length is None
    assert policy.models["local"].prices.input_per_mtok == 0  # an engine you run has no list price
    assert loader.parse(POLICY, catalogued=False).models["gpt-4o"].prices.input_per_mtok == 0


def test_validate_explain_says_where_each_figure_came_from(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    out = CliRunner().invoke(app, ["validate", "--explain", str(path)])
    assert out.exit_code == 0, out.output
    lines = {line.split(":")[0].strip(): line for line in out.output.splitlines() if line.startswith("  ")}
    assert f"litellm {catalogue.version()} catalogue: gpt-4o" in lines["gpt-4o"]
    assert lines["priced"].count("(policy)") == 2
    assert lines["unknown"].count("(default)") == 2
