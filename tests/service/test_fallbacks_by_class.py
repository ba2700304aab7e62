"""Fallbacks by error class (a model's `fallbacks_on`): a context window exceeded, a rate limit, a
content-policy refusal, a timeout and a server error each take their own fallback, read from the
engine's own answer; the fallbacks taken are in a header and the log. A fake engine (real uvicorn)
answers each error as engines and providers do; the answers come from a real triage gateway on a
scripted backend. The real engines' own context overflows are in test_fallbacks_engines.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.conftest import Gateway
from tests.http.test_hardening import policy
from tests.servers import asgi_server

ANSWERS = {
    "toolong": (400, {"error": {"message": "This model's maximum context length is 2048 tokens", "code": 400}}),
    "limited": (429, {"error": {"message": "Rate limit reached for requests", "type": "requests"}}),
    "filtered": (400, {"error": {"message": "flagged", "code": "content_filter", "type": "invalid_request_error"}}),
    "broken": (500, {"error": {"message": "CUDA error: an illegal memory access"}}),
    "refused": (400, {"error": {"message": "messages: field required", "type": "invalid_request_error"}}),
}


async def fake_engine(request: Request) -> JSONResponse:
    kind = request.url.path.strip("/").split("/")[0]
    if kind == "slow":
        await asyncio.sleep(5)
    status, body = ANSWERS.get(kind, (500, {"error": {"message": "?"}}))
    return JSONResponse(body, status, headers={"retry-after": "7"} if status == 429 else None)


@pytest.fixture
def engine() -> Iterator[str]:
    with asgi_server(Starlette(routes=[Route("/{path:path}", fake_engine, methods=["GET", "POST"])])) as url:
        yield url


def test_each_error_class_takes_its_own_fallback(gateway: Callable[..., Gateway], engine: str) -> None:
    good = gateway(policy())  # a real OpenAI-compatible upstream: a triage gateway on a scripted backend
    backends = "".join(
        f"  {k}: {{type: openai, replicas: [{{api_base: '{engine}/{k}'}}], health: {{enabled: false}}, "
        f"retries: {{attempts: 1}}, timeouts: {{total_s: 0.5, first_byte_s: 0.5}}}}\n"
        for k in (*ANSWERS, "slow")
    )
    on = (
        "{context_window: [long], rate_limit: [spare], content_policy: [lenient], timeout: [fast], "
        "server_error: [other]}"
    )
    models = "".join(f"  {k}: {{backend: {k}, upstream: scripted, fallbacks_on: {on}}}\n" for k in (*ANSWERS, "slow"))
    for fb in ("long", "spare", "lenient", "fast", "other"):
        models += f"  {fb}: {{backend: good, upstream: scripted}}\n"
    gw = gateway(
        f"""version: 1
backends:
{backends}  good: {{type: openai, replicas: [{{api_base: '{good.base_url}/v1'}}], health: {{enabled: false}}}}
models:
{models}"""
    )
    expect = {
        "toolong": "long (context_window)",
        "limited": "spare (rate_limit)",
        "filtered": "lenient (content_policy)",
        "slow": "fast (timeout)",
        "broken": "other (server_error)",
    }
    msg = [{"role": "user", "content": "hi"}]
    with gw.http() as http, structlog.testing.capture_logs() as logs:
        for model, taken in expect.items():
            r = http.post("/v1/chat/completions", json={"model": model, "messages": msg})
            assert r.status_code == 200, (model, r.text)
            served, why = taken.split(" ")
            assert r.headers["x-triage-model"] == served
            assert r.headers["x-triage-fallbacks"] == f"{model} {why}"
        refused = http.post("/v1/chat/completions", json={"model": "refused", "messages": msg})
    assert refused.status_code == 400  # the request's own fault: no fallback, its status passes through
    failed = {e["model"]: e["error_class"] for e in logs if e["event"] == "model_failed"}
    assert failed == {m: t.split("(")[1].rstrip(")") for m, t in expect.items()}
    done = [e for e in logs if e["event"] == "request" and e.get("fallbacks")]
    assert {e["fallbacks"][0]["model"] for e in done} == set(expect)


def test_without_a_fallback_for_its_class_a_refusal_passes_through(
    gateway: Callable[..., Gateway], engine: str
) -> None:
    gw = gateway(
        f"""version: 1
backends:
  toolong: {{type: openai, replicas: [{{api_base: '{engine}/toolong'}}], health: {{enabled: false}}}}
  limited: {{type: openai, replicas: [{{api_base: '{engine}/limited'}}], health: {{enabled: false}},
            retries: {{attempts: 1}}}}
models:
  toolong: {{backend: toolong, fallbacks_on: {{rate_limit: [limited]}}}}
  limited: {{backend: limited}}
"""
    )
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "toolong", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_an_unknown_error_class_or_fallback_is_refused_with_its_place() -> None:
    from tests.policies.test_policy import problems

    text = """version: 1
backends: {script: {type: scripted}}
models:
  a: {backend: script, fallbacks_on: {overload: [b]}}
  b: {backend: script}
"""
    found = problems(text)
    assert any(p.startswith("p.yaml:4:39: models.a.fallbacks_on.overload.[key]: Input should be") for p in found), found
    ghost = """version: 1
backends: {script: {type: scripted}}
models:
  a: {backend: script, fallbacks_on: {rate_limit: [ghost, a]}}
"""
    assert problems(ghost) == [
        "p.yaml:4:52: models.a.fallbacks_on.rate_limit[0]: model 'ghost' is not defined",
        "p.yaml:4:59: models.a.fallbacks_on.rate_limit[1]: a model cannot fall back to itself",
    ]


def test_a_rate_limited_replica_stays_out_as_long_as_its_retry_after_says(
    gateway: Callable[..., Gateway], engine: str
) -> None:
    gw = gateway(
        f"""version: 1
backends:
  limited: {{type: openai, replicas: [{{api_base: '{engine}/limited'}}], retries: {{attempts: 1}},
            health: {{enabled: false, cooldown_s: 0.5}}}}
  spare: {{type: scripted}}
models:
  limited: {{backend: limited, fallbacks_on: {{rate_limit: [spare]}}}}
  spare: {{backend: spare}}
"""
    )
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "limited", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.headers["x-triage-fallbacks"] == "limited (rate_limit)"
    rs = gw.app.state.triage.holder.current.backends["limited"].replicas  # type: ignore[attr-defined]
    left = rs.replicas[0].ejected_until - rs.clock()
    assert 5.0 < left <= 7.0  # the engine's retry-after (7 s), not the policy's cooldown (0.5 s)


def test_retry_after_is_read_as_seconds_and_bounded() -> None:
    from backends.openai_compat import retry_after

    assert [retry_after(v) for v in ("7", "0.5", "86400", "-1", "nan", "Wed, 21 Oct 2015 07:28:00 GMT", None)] == [
        7.0,
        0.5,
        3600.0,
        None,
        None,
        None,
        None,
    ]
