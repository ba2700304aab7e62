"""OpenTelemetry tracing (issue 18, item 7): a real OTLP/HTTP receiver in the test (protobuf, decoded
with ``opentelemetry.proto``), two `triage serve` processes exporting to it, one the other's
upstream: the request spans, the cascade's tiers, the upstream calls and their replica tries, and the
caller's trace continued across both. Off: no SDK imported, nothing exported. A collector that is
down fails no request."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.obs import tracing
from policies.schema import TracingSpec
from tests import lanes
from tests.conftest import Gateway, GatewayRunner, free_port, wait_http

KEY = "sk-alpha-secret"
QUESTION = "Which colour is the sky on a clear day?"
MSG = [{"role": "user", "content": "hi"}]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class Receiver:
    """An OTLP/HTTP traces endpoint: POST /v1/traces, ExportTraceServiceRequest in protobuf."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[Span] = []
        self.posts = 0
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest.FromString(body)
                received.take(request, self.path)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, request: Any, path: str) -> None:
        assert path == "/v1/traces", path
        self.posts += 1
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        Span(
                            resource["service.name"],
                            s.name,
                            s.kind,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            {a.key: _value(a.value) for a in s.attributes},
                            s.status.code,
                        )
                    )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _env(**extra: str) -> dict[str, str]:
    """This environment without any OTEL_ setting (a developer's own collector is not the test's)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FASTAPI_OTEL"))}, **extra}


@pytest.fixture
@lanes.fleet
def serve(tmp_path: Path) -> Iterator[Callable[[str], tuple[str, subprocess.Popen]]]:
    """``serve(policy_yaml)``: a `triage serve` process; its base URL and the process."""
    procs: list[subprocess.Popen] = []

    def start(text: str) -> tuple[str, subprocess.Popen]:
        path = tmp_path / f"policy-{len(procs)}.yaml"
        path.write_text(text)
        port = free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(path), "--port", str(port), "--no-watch"]
        with (tmp_path / f"gateway-{port}.log").open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
        procs.append(proc)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {(tmp_path / f'gateway-{port}.log').read_text()[-2000:]}") from None
        return f"http://127.0.0.1:{port}", proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM: the gateway stops as in production, flushing its last spans on the way out."""
    proc.terminate()
    assert proc.wait(30) in (0, -15)  # uvicorn re-raises the signal once it has shut down


ENGINE = """version: 1
backends:
  say: {{type: scripted, text: "B"}}
models:
  m: {{backend: say}}
tracing: {{otlp_endpoint: "{otlp}", service_name: engine}}
"""

FRONT = """version: 1
backends:
  pool:
    type: openai
    strategy: round_robin  # by weight: the dead replica first
    replicas:
      - {{api_base: "{dead}", weight: 1000}}
      - {{api_base: "{engine}"}}
    retries: {{attempts: 2, backoff_s: 0}}
    health: {{enabled: false}}
  flaky: {{type: scripted, text: "B", fail_first: 1}}
  cheap: {{type: scripted, text: "B"}}
models:
  big: {{backend: pool, upstream: m, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
  flaky: {{backend: flaky, fallbacks: [cheap]}}
  cheap: {{backend: cheap}}
keys:
  - {{name: alpha, sha256: "{sha}"}}
cascade:
  tiers:
    - {{name: first, type: model, model: flaky, logprobs: false, assumed_confidence: 0.6, thresholds: {{choice: 0.7}}}}
    - {{name: last, type: model, model: big, logprobs: false}}
tracing: {{otlp_endpoint: "{otlp}", service_name: front}}
"""


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent == parent.span_id and s.trace_id == parent.trace_id]


def _one(spans: list[Span], **where: Any) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (where, [(s.service, s.name) for s in spans])
    return found[0]


def test_requests_tiers_and_upstream_tries_are_spans_of_the_callers_trace(
    receiver: Receiver, serve: Callable[[str], tuple[str, subprocess.Popen]]
) -> None:
    engine, engine_proc = serve(ENGINE.format(otlp=receiver.url))
    dead = f"http://127.0.0.1:{free_port()}/v1"
    sha = hashlib.sha256(KEY.encode()).hexdigest()
    front, front_proc = serve(FRONT.format(otlp=receiver.url, dead=dead, engine=engine + "/v1", sha=sha))
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=front, headers=auth, timeout=30) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"model": "big", "messages": [{"role": "user", "content": QUESTION}]},
            headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "x-request-id": "trace-chat"},
        )
        assert chat.status_code == 200, chat.text
        decide = http.post("/v1/decide", json={"question": QUESTION, "type": "choice", "options": ["red", "blue"]})
        assert decide.status_code == 200, decide.text
        assert decide.json()["tier"] == "last"
        assert http.get("/health").status_code == 200  # a probe: no span
    _stop(front_proc)
    _stop(engine_proc)  # both flushed at exit: every span is in now
    spans = receiver.spans
    assert all(s.name != "GET /health" and s.attributes.get("url.path") != "/health" for s in spans)

    # the chat request continues the caller's trace: front's server span, its upstream call, two tries
    server = _one(spans, service="front", name="POST /v1/chat/completions")
    assert (server.trace_id, server.parent, server.kind) == (CALLER_TRACE, CALLER_SPAN, 2)  # SPAN_KIND_SERVER
    a = server.attributes
    assert a["http.request.method"] == "POST" and a["http.route"] == "/v1/chat/completions"
    assert a["http.response.status_code"] == 200 and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "big" and a["gen_ai.response.model"] == "big"
    assert a["triage.request_id"] == "trace-chat" and a["triage.key.name"] == "alpha"
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 1 and a["triage.cost"] > 0
    assert a["triage.backend"] == "pool" and a["triage.attempts"] == 2
    [call] = _children(spans, server)
    assert (call.name, call.kind, call.status) == ("chat m", 3, 0)  # SPAN_KIND_CLIENT
    c = call.attributes
    assert (c["triage.model"], c["triage.backend"], c["gen_ai.request.model"]) == ("big", "pool", "m")
    assert c["triage.fallback"] is False and c["triage.attempts"] == 2 and c["triage.replica"] == engine + "/v1"
    assert c["gen_ai.usage.output_tokens"] == 1
    tries = sorted(
        (s for s in _children(spans, call) if s.name == "triage.attempt"),
        key=lambda s: s.attributes["triage.attempt.number"],
    )
    assert [(t.attributes["triage.replica"], t.attributes["triage.attempt.outcome"], t.status) for t in tries] == [
        (dead, "error", 2),
        (engine + "/v1", "ok", 0),
    ]
    assert tries[1].attributes["triage.retry"] is True
    # ... and the engine's own server span is a child of that upstream call: traceparent went upstream
    remote = _one(spans, service="engine", name="POST /v1/chat/completions", trace_id=CALLER_TRACE)
    assert remote.parent == call.span_id and remote.attributes["http.response.status_code"] == 200

    # the decision: its cascade, the tier that escalated (and its model's failover), the tier that answered
    top = _one(spans, service="front", name="POST /v1/decide")
    assert top.parent == "" and top.attributes["triage.decision.tier"] == "last"
    assert top.attributes["triage.key.name"] == "alpha" and top.attributes["http.response.status_code"] == 200
    [run] = _children(spans, top)
    assert run.name == "triage.cascade" and run.attributes["triage.decision.tier"] == "last"
    assert run.attributes["triage.question.type"] == "choice" and run.attributes["triage.cascade.tiers_asked"] == 2
    first = _one(_children(spans, run), name="triage.tier first")
    last = _one(_children(spans, run), name="triage.tier last")
    f, la = first.attributes, last.attributes
    assert f["triage.tier.escalated"] is True and f["triage.tier.outcome"] == "escalated"
    assert f["triage.tier.confidence"] == pytest.approx(0.6) and f["triage.tier.threshold"] == pytest.approx(0.7)
    assert la["triage.tier.escalated"] is False and la["triage.tier.outcome"] == "accepted"
    calls = {s.name: s for s in _children(spans, first)}
    assert set(calls) == {"chat flaky", "chat cheap"}
    failed, fallback = calls["chat flaky"], calls["chat cheap"]
    assert failed.status == 2 and failed.attributes["triage.fallback"] is False
    assert fallback.status == 0 and fallback.attributes["triage.fallback"] is True
    assert [t.attributes["triage.attempt.outcome"] for t in _children(spans, failed)] == ["error"]
    [pool_call] = _children(spans, last)
    assert pool_call.name == "chat m" and pool_call.attributes["triage.attempts"] == 1  # the dead replica is ejected
    remote_tier = _one(spans, service="engine", name="POST /v1/chat/completions", trace_id=top.trace_id)
    assert remote_tier.parent == pool_call.span_id

    # never a key, a prompt or an answer in any attribute
    for s in spans:
        for value in s.attributes.values():
            assert KEY not in str(value) and QUESTION not in str(value), (s.name, value)


OFF_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from starlette.testclient import TestClient
    from gateway.http.app import create_app
    from gateway.http.settings import Settings

    settings = Settings(policy_path=Path(sys.argv[1]), watch_policy=False, handle_sighup=False, configure_logging=False)
    with TestClient(create_app(settings)) as client:
        chat = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        decide = client.post("/v1/decide", json={"question": "Pick.", "type": "choice", "options": ["x", "y"]})
    loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
    print(json.dumps({"status": [chat.status_code, decide.status_code], "loaded": loaded}))
    """
)

OFF = """version: 1
backends:
  say: {{type: scripted, text: "B"}}
models:
  m: {{backend: say}}
cascade:
  tiers:
    - {{name: only, type: model, model: m, logprobs: false}}
{tracing}"""


@pytest.mark.parametrize(
    ("section", "env"),
    [("", {}), ('tracing: {{otlp_endpoint: "{otlp}"}}\n', {"OTEL_SDK_DISABLED": "true"})],
    ids=["no-endpoint", "sdk-disabled"],
)
def test_off_imports_no_sdk_and_exports_nothing(
    receiver: Receiver, tmp_path: Path, section: str, env: dict[str, str]
) -> None:
    """In a process of its own: the app built in-process, a chat and a decision served, and neither
    the SDK nor the exporter ever imported (another test of this run may have imported them here)."""
    path = tmp_path / "policy.yaml"
    path.write_text(OFF.format(tracing=section.format(otlp=receiver.url)))
    out = subprocess.run(
        [sys.executable, "-c", OFF_SCRIPT, str(path)], env=_env(**env), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"status": [200, 200], "loaded": []}
    assert receiver.posts == 0 and receiver.spans == []


def _tracer_of(gw: Gateway) -> Any:
    """The app's tracer (None: tracing is off), from its tracing middleware."""
    [entry] = [m for m in gw.app.user_middleware if m.cls is tracing.Middleware]  # type: ignore[attr-defined]
    return entry.kwargs["tracing"].tracer


def test_a_collector_that_is_down_fails_no_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exporter is batched in its own thread: while its exports fail (and it logs them),
    requests answer as usual and in time; the gateway stops within the export timeout."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export (and fail) while requests are served
    runner = GatewayRunner(tmp_path)
    try:
        gw = runner.start(
            OFF.format(tracing=f'tracing: {{otlp_endpoint: "http://127.0.0.1:{free_port()}", export_timeout_s: 1}}\n')
        )
        assert _tracer_of(gw) is not None
        took = []
        with gw.http() as http:
            for _ in range(30):
                t0 = time.perf_counter()
                chat = http.post(
                    "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                )
                took.append(time.perf_counter() - t0)
                assert chat.status_code == 200, chat.text
                time.sleep(0.05)
            decide = http.post("/v1/decide", json={"question": "Pick.", "type": "choice", "options": ["x", "y"]})
            assert decide.status_code == 200, decide.text
        # a request that waited on the failing exports would take about a second (its retry's backoff),
        # and so would most of them; the median, not the slowest, so that one stall of a loaded machine
        # (CI's) does not fail it (one request took 1.5 s there once, beside a test run)
        assert statistics.median(took) < 0.25, sorted(took)
    finally:
        t0 = time.perf_counter()
        runner.stop_all()
    assert time.perf_counter() - t0 < 5 and not any(t.is_alive() for _, t in runner.servers)


FAILING = """version: 1
backends:
  down: {{type: scripted, fail_first: 1000}}
  say: {{type: scripted, text: "one two three", chunks: 3}}
models:
  m: {{backend: say}}
  broken: {{backend: down}}
cascade:
  tiers:
    - {{name: only, type: model, model: broken, logprobs: false}}
tracing: {{otlp_endpoint: "{otlp}"}}
"""


def test_failures_are_error_spans_and_a_stream_ends_its_span(receiver: Receiver, tmp_path: Path) -> None:
    """In-process (the provider is the app's own, not the global one): a decision no tier could
    make, a model that fails, and a streamed chat whose span ends with the stream."""
    runner = GatewayRunner(tmp_path)
    try:
        gw = runner.start(FAILING.format(otlp=receiver.url))
        with gw.http() as http:
            exhausted = http.post("/v1/decide", json={"question": "Pick.", "type": "choice", "options": ["x", "y"]})
            assert exhausted.status_code == 502 and exhausted.json()["error"]["code"] == "cascade_exhausted"
            assert http.post("/v1/chat/completions", json={"model": "broken", "messages": MSG}).status_code == 502
            with http.stream("POST", "/v1/chat/completions", json={"model": "m", "messages": MSG, "stream": True}) as r:
                assert r.status_code == 200 and b"[DONE]" in r.read()
            assert http.get("/v1/nowhere").status_code == 404
    finally:
        runner.stop_all()  # flushes
    spans = receiver.spans
    decide = _one(spans, name="POST /v1/decide")
    assert decide.status == 2 and decide.attributes["http.response.status_code"] == 502
    assert decide.attributes["error.type"] == "502" and decide.attributes["triage.error.code"] == "cascade_exhausted"
    [run] = _children(spans, decide)
    assert run.status == 2 and run.attributes["error.type"] == "cascade_exhausted"
    [tier] = _children(spans, run)
    assert tier.name == "triage.tier only" and tier.status == 2
    assert tier.attributes["triage.tier.outcome"] == "failed" and tier.attributes["triage.tier.escalated"] is True
    [call] = _children(spans, tier)
    assert call.name == "chat broken" and call.status == 2 and call.attributes["error.type"] == "bad_gateway"
    chats = [s for s in spans if s.name == "POST /v1/chat/completions"]
    failed = _one(chats, status=2)
    assert (
        failed.attributes["gen_ai.request.model"] == "broken"
        and failed.attributes["triage.error.type"] == "upstream_error"
    )
    streamed = _one(chats, status=0)
    assert streamed.attributes["triage.stream"] is True and streamed.attributes["http.response.status_code"] == 200
    [opened] = _children(spans, streamed)
    assert opened.name == "chat m" and opened.attributes["triage.stream"] is True
    unrouted = _one(spans, name="GET")  # no route: the method alone names it, never the path
    assert unrouted.attributes["http.response.status_code"] == 404 and unrouted.status == 0


SAMPLED = """version: 1
backends:
  pool:
    type: openai
    replicas: [{{api_base: "{engine}"}}]
    health: {{enabled: false}}
models:
  big: {{backend: pool, upstream: m}}
tracing: {{otlp_endpoint: "{otlp}", service_name: front, sample_ratio: 0}}
"""


def test_sampling_follows_the_caller_and_the_decision_goes_upstream(receiver: Receiver, tmp_path: Path) -> None:
    """Two gateways in one process (each its own provider): the front keeps no new trace (ratio 0)
    but keeps a caller's sampled one; its traceparent tells the engine (ratio 1) either way."""
    runner = GatewayRunner(tmp_path)
    try:
        engine = runner.start(ENGINE.format(otlp=receiver.url))
        front = runner.start(SAMPLED.format(engine=engine.base_url + "/v1", otlp=receiver.url))
        body = {"model": "big", "messages": MSG}
        with front.http() as http:
            assert http.post("/v1/chat/completions", json=body).status_code == 200
            sampled = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
            assert http.post("/v1/chat/completions", json=body, headers=sampled).status_code == 200
    finally:
        runner.stop_all()
    # the front asks the engine for its models' contexts once at start-up (GET /v1/models): no request's
    receiver.spans[:] = [s for s in receiver.spans if not s.name.startswith("GET")]
    assert {s.trace_id for s in receiver.spans} == {CALLER_TRACE}  # the unsampled request: no span anywhere
    assert {(s.service, s.name) for s in receiver.spans} == {
        ("front", "POST /v1/chat/completions"),
        ("front", "chat m"),
        ("front", "triage.attempt"),
        ("engine", "POST /v1/chat/completions"),
        ("engine", "chat m"),
        ("engine", "triage.attempt"),
    }


def test_the_endpoint_is_the_policys_else_the_environments() -> None:
    spec, env = TracingSpec(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert tracing.export_endpoint(spec, {}) is None
    assert tracing.export_endpoint(spec, env) == "http://collector:4318/v1/traces"
    full = {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:4318/custom"}
    assert tracing.export_endpoint(spec, full) == "http://other:4318/custom"  # the signal's own: a full URL
    mine = TracingSpec(otlp_endpoint="http://mine:4318")
    assert tracing.export_endpoint(mine, full) == "http://mine:4318/v1/traces"
    assert tracing.export_endpoint(mine, {"OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.export_endpoint(mine, {"OTEL_TRACES_EXPORTER": "none"}) is None
    with pytest.raises(ValueError, match="http"):
        TracingSpec(otlp_endpoint="collector:4318")
