"""The guardrails on a real gateway with scripted backends (no encoder): PII masked before the
engine sees it and restored in the answer (whole and streamed, on chat, Responses and Anthropic's
Messages), refused with a 400 naming the guardrail, found in an answer and the stream cut in-band;
an operator's HTTP hook that refuses, and one that passes its deadline following on_error; what
each key gets; the counts on /metrics."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Gateway
from tests.servers import free_port

CARD = "4111 1111 1111 1111"
MAIL = "jane.doe@example.com"


def policy(guardrails: str, backend: str = "{type: scripted, echo: true}", keys: str = "") -> str:
    return f"""version: 1
backends:
  s: {backend}
models:
  m: {{backend: s}}
{keys}
guardrails:
{guardrails}
"""


PII = """  checks:
    pii: {type: pii, action: mask, stage: both}
"""


def sent(answer: str) -> str:
    """The last user message the echoing engine received."""
    return str(json.loads(answer)["messages"][-1]["content"])


def test_pii_is_masked_before_the_engine_and_restored_in_the_answer(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(PII))
    client = gw.client()
    ask = [{"role": "user", "content": f"My card is {CARD} and my mail {MAIL}; my mail again: {MAIL}"}]
    out = client.chat.completions.create(model="m", messages=ask)
    # the engine saw placeholders; the answer (its echo) came back with the values
    assert out.choices[0].message.content is not None
    answer = out.choices[0].message.content
    assert CARD in answer and MAIL in answer and "[CREDIT_CARD_1]" not in answer


REPLY = (
    '{type: scripted, chunks: 9, replies: [{contains: "[EMAIL_1]", '
    'text: "I will write to [EMAIL_1] about card [CREDIT_CARD_1] today, promptly and in full detail."}]}'
)


def test_a_streamed_answer_gets_the_values_back_on_every_surface(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(PII, REPLY))
    ask = f"Mail {MAIL}, card {CARD}."
    want = f"I will write to {MAIL} about card {CARD} today, promptly and in full detail."
    client = gw.client()
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}])
    assert whole.choices[0].message.content == want
    chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    with client.responses.stream(model="m", input=ask) as events:
        assert events.get_final_response().output_text == want
    claude = anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0)
    with claude.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": ask}]) as s:
        assert s.get_final_text() == want
    claude.close()


def test_refused_pii_is_a_400_naming_the_guardrail_on_each_surface(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("  checks:\n    no-cards: {type: pii, entities: [credit_card], action: refuse}\n"))
    ask = f"charge {CARD} please"
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().chat.completions.create(model="m", messages=[{"role": "user", "content": ask}])
    assert err.value.status_code == 400 and isinstance(err.value.body, dict)
    assert err.value.body["guardrail"] == "no-cards" and err.value.body["code"] == "guardrail_refused"
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().responses.create(model="m", input=ask)
    assert "no-cards" in err.value.message
    claude = anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        claude.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": ask}])
    assert "no-cards" in str(aerr.value) and aerr.value.body["type"] == "error"  # type: ignore[index]
    claude.close()
    # no card: it goes through
    assert gw.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices


LEAKY = (
    "{type: scripted, chunks: 12, "
    "text: 'Sure. The number on file is 4111 1111 1111 1111 and that is all I know about it, truly.'}"
)


def test_an_answer_that_fails_an_output_guardrail_is_refused_and_a_stream_is_cut_in_band(
    gateway: Callable[..., Gateway],
) -> None:
    gw = gateway(
        policy("  checks:\n    out: {type: pii, entities: [credit_card], action: refuse, stage: output}\n", LEAKY)
    )
    msg = [{"role": "user", "content": "what card is on file?"}]
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().chat.completions.create(model="m", messages=msg)
    assert isinstance(err.value.body, dict) and err.value.body["guardrail"] == "out"
    with (
        gw.http() as http,
        http.stream("POST", "/v1/chat/completions", json={"model": "m", "messages": msg, "stream": True}) as r,
    ):
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-2]) if c.get("choices")
    )
    assert CARD not in text  # held back, never sent
    error = json.loads(events[-2])["error"]
    assert error["guardrail"] == "out" and error["code"] == "guardrail_refused" and events[-1] == "[DONE]"


def test_an_output_pii_mask_redacts_the_answer(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("  checks:\n    out: {type: pii, action: mask, restore: false, stage: output}\n", LEAKY))
    msg = [{"role": "user", "content": "what card is on file?"}]
    whole = gw.client().chat.completions.create(model="m", messages=msg).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in gw.client().chat.completions.create(model="m", messages=msg, stream=True)
        if c.choices
    )
    want = "Sure. The number on file is [CREDIT_CARD] and that is all I know about it, truly."
    assert whole == streamed == want


class _Hook(BaseHTTPRequestHandler):
    delay = 0.0
    seen: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        doc = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append(doc)
        time.sleep(type(self).delay)
        flagged = "forbidden" in doc["text"]
        body = json.dumps({"flagged": flagged, "reason": "the word" if flagged else None}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def hook() -> Iterator[type[_Hook]]:
    _Hook.delay, _Hook.seen = 0.0, []
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hook.url = f"http://127.0.0.1:{server.server_address[1]}/check"  # type: ignore[attr-defined]
    yield _Hook
    server.shutdown()
    server.server_close()


def keys(*names: str) -> str:
    return "keys:\n" + "".join(f'  - {{name: {n}-key, sha256: "{_sha(n)}"}}\n' for n in names)


def test_a_hook_refuses_and_one_past_its_deadline_follows_on_error(
    gateway: Callable[..., Gateway], hook: type[_Hook]
) -> None:
    url = hook.url  # type: ignore[attr-defined]
    rails = f"""  checks:
    open: {{type: hook, url: "{url}", timeout_s: 0.3, on_error: allow}}
    shut: {{type: hook, url: "{url}", timeout_s: 0.3, on_error: refuse}}
  default: [open]
"""
    gw = gateway(policy(rails))
    client = gw.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a forbidden word"}])
    assert isinstance(err.value.body, dict) and err.value.body["guardrail"] == "open"
    assert hook.seen[-1]["stage"] == "input" and hook.seen[-1]["guardrail"] == "open"
    hook.delay = 1.0  # past both deadlines
    t0 = time.monotonic()
    ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a forbidden word"}])
    assert ok.choices and time.monotonic() - t0 < 0.9  # on_error: allow, at the deadline
    metrics = httpx.get(gw.base_url + "/metrics").text
    assert 'triage_guardrail_errors_total{guardrail="open",on_error="allow"} 1.0' in metrics
    assert 'triage_guardrail_hits_total{action="refuse",guardrail="open"} 1.0' in metrics


def test_which_guardrails_a_key_gets(gateway: Callable[..., Gateway], hook: type[_Hook]) -> None:
    url = hook.url  # type: ignore[attr-defined]
    rails = f"""  checks:
    slow: {{type: hook, url: "{url}", timeout_s: 0.2, on_error: refuse}}
    pii: {{type: pii, action: refuse}}
  keys: {{open-key: [pii]}}
"""
    hook.delay = 0.5
    gw = gateway(policy(rails, keys=keys("open", "shut")))
    with pytest.raises(openai.BadRequestError) as err:  # every guardrail: the hook's deadline refuses
        gw.client("shut").chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
    assert isinstance(err.value.body, dict) and err.value.body["guardrail"] == "slow"
    assert gw.client("open").chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}]).choices


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def test_the_console_shows_each_guardrails_hits_without_the_text(
    gateway: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.http import console_auth

    monkeypatch.setenv(console_auth.SECRET_ENV, "console-test-secret")
    console_auth.secret.cache_clear()
    admin = "sk-admin-guardrails"
    rails = "  checks:\n    no-cards: {type: pii, entities: [credit_card], action: refuse}\n"
    gw = gateway(policy(rails, keys=keys("user")) + f'access: {{admin_key: "{_sha(admin)}"}}\n')
    with pytest.raises(openai.BadRequestError):
        gw.client("user").chat.completions.create(model="m", messages=[{"role": "user", "content": f"pay with {CARD}"}])
    with httpx.Client(base_url=gw.base_url, timeout=30) as http:
        r = http.post("/console/login", data={"key": admin, "next": "/console"}, headers={"origin": gw.base_url})
        assert r.status_code == 303
        page = http.get("/console/guardrails")
    console_auth.secret.cache_clear()
    assert page.status_code == 200 and "no-cards" in page.text and "credit_card" in page.text
    assert CARD not in page.text and "pay with" not in page.text
    assert '<a href="/console/guardrails"' in page.text or "/console/guardrails" in page.text


def test_a_stream_that_fails_is_cut_in_band_on_responses_and_messages(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(
        policy("  checks:\n    out: {type: pii, entities: [credit_card], action: refuse, stage: output}\n", LEAKY)
    )
    asks = {
        "/v1/responses": {"model": "m", "input": "what card is on file?", "stream": True},
        "/v1/messages": {
            "model": "m",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": "what card is on file?"}],
        },
    }
    for path, body in asks.items():
        with gw.http() as http, http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = list(r.iter_lines())
        events = [line[7:] for line in lines if line.startswith("event: ")]
        text = "\n".join(lines)
        assert "error" in events and CARD not in text and "'out'" in text, (path, events)
        if path == "/v1/responses":
            assert events[-1] == "response.failed" and "guardrail_refused" in text
