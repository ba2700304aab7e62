"""A fuzz run on the OpenAPI document (issue 16): schemathesis generates requests for every
operation, valid and not, against a running gateway; none may be a 500 (or any 5xx the document
does not name), and every error is in the API's own shape. A bounded run here; ``make fuzz`` runs
more (FUZZ_EXAMPLES)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gateway.http.openapi import document  # noqa: E402
from tests import lanes  # noqa: E402
from tests.conftest import Gateway, GatewayRunner  # noqa: E402
from tests.http.test_hardening import policy  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))  # per operation
HOSTILE = int(os.environ.get("FUZZ_HOSTILE", str(2 * EXAMPLES)))  # schemas sent to the in-process engine
schema = schemathesis.openapi.from_dict(document("triage", "0.1.0", keys=False))
keyed_schema = schemathesis.openapi.from_dict(document("triage", "0.1.0", keys=True))
KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("fuzz")
    runner = GatewayRunner(tmp)
    yield runner.start(policy(extra=f'batches: {{dir: "{tmp / "b"}", min_expires_after_s: 1}}\n'))
    runner.stop_all()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The same gateway with API keys on (the fuzzer sends the key: the authorised paths run)."""
    import hashlib

    tmp = tmp_path_factory.mktemp("fuzz-keyed")
    runner = GatewayRunner(tmp)
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    extra = f'batches: {{dir: "{tmp / "b"}", min_expires_after_s: 1}}\nkeys:\n  - {{name: fuzz, sha256: {digest}}}\n'
    yield runner.start(policy(extra=extra))
    runner.stop_all()


def documented(case: schemathesis.Case, status: int) -> bool:
    return str(status) in case.operation.definition.raw["responses"]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_500_and_every_error_in_the_api_shape(case: schemathesis.Case, fuzzed: Gateway) -> None:
    _check(case, case.call(base_url=fuzzed.base_url, timeout=30))


@keyed_schema.parametrize()
@settings(
    max_examples=max(1, EXAMPLES // 5),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_with_keys_on_no_500_either(case: schemathesis.Case, keyed: Gateway) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
    _check(case, case.call(base_url=keyed.base_url, timeout=30, headers=headers))


def _check(case: schemathesis.Case, resp: Any) -> None:
    assert resp.status_code != 500, (case.method, case.path, resp.text[:500])
    assert resp.status_code < 500 or documented(case, resp.status_code), (case.method, case.path, resp.status_code)
    media = (resp.headers.get("content-type") or [""])[0]  # schemathesis keeps each header's values in a list
    if resp.status_code >= 400 and media.startswith("application/json") and case.path == "/v1/messages":
        body = resp.json()  # Anthropic's shape
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), resp.text[:500]
        assert isinstance(body["error"]["type"], str)
    elif resp.status_code >= 400 and media.startswith("application/json"):
        error = resp.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), resp.text[:500]  # extensions (a trace) may follow
        assert isinstance(error["message"], str) and isinstance(error["type"], str)


# --- several keys: two owners, a restricted key, an operator, and the admin API -----------------------------

OWNERS = {"alice": "sk-fuzz-alice", "bob": "sk-fuzz-bob", "narrow": "sk-fuzz-narrow", "ops": "sk-fuzz-ops"}
ADMIN = "sk-fuzz-admin"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway, four keys (``narrow`` may use one model; ``ops`` sees every key's objects) and
    the admin key."""
    tmp = tmp_path_factory.mktemp("fuzz-shared")
    keys = "".join(
        f"  - {{name: {name}, sha256: {hashlib.sha256(k.encode()).hexdigest()}"
        + (", models: [scripted]" if name == "narrow" else "")
        + "}\n"
        for name, k in OWNERS.items()
    )
    admin = hashlib.sha256(ADMIN.encode()).hexdigest()
    extra = (
        f'batches: {{dir: "{tmp / "b"}", min_expires_after_s: 1}}\nkeys:\n{keys}'
        f'access: {{operator_keys: [ops], admin_key: "{admin}"}}\n'
    )
    runner = GatewayRunner(tmp)
    yield runner.start(policy(extra=extra))
    runner.stop_all()


def headers_of(who: str) -> dict[str, str]:
    key = OWNERS.get(who, ADMIN)
    return {"Authorization": f"Bearer {key}", "x-api-key": key}


@keyed_schema.given(who=st.sampled_from([*OWNERS, "admin"]))
@keyed_schema.parametrize()
@settings(
    max_examples=max(1, EXAMPLES // 5),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_every_key_no_500_either(case: schemathesis.Case, who: str, shared: Gateway) -> None:
    _check(case, case.call(base_url=shared.base_url, timeout=30, headers=headers_of(who)))


class Owners:
    """Who made each object (file, batch, stored response), and every sighting of one by another
    key that is not an operator: what must never happen."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}
        self.crossed: list[tuple[str, str, str, str]] = []
        self.tried = 0  # asks naming another key's object (each must be refused)
        self.failed: list[str] = []

    def saw(self, who: str, case: schemathesis.Case, status: int, body: Any) -> None:
        if who in ("ops", "admin"):
            return
        asked = [str(v) for v in (case.path_parameters or {}).values()]
        if case.method == "POST" and case.path == "/v1/responses" and isinstance(case.body, dict):
            asked.append(str(case.body.get("previous_response_id")))
        self.tried += sum(self.owner.get(oid, who) != who for oid in asked)
        if status != 200:
            return
        ids = _ids(body)
        if case.method == "POST" and case.path in ("/v1/files", "/v1/batches", "/v1/responses") and ids:
            self.owner.setdefault(ids[0], who)  # the first id of a creation's answer is the new object's
        for oid in {*ids, *asked}:
            if self.owner.get(oid, who) != who:
                self.crossed.append((who, case.method, case.path, oid))


def _ids(body: Any) -> list[str]:
    """Object ids in an answer: its own and those it lists (files, batches, responses)."""
    if not isinstance(body, dict):
        return []
    found = [body["id"]] if isinstance(body.get("id"), str) else []
    for item in body.get("data") or []:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            found.append(item["id"])
    return found


def test_stateful_links_across_owners_never_show_one_keys_object_to_another(shared: Gateway) -> None:
    """Sequences that follow the document's links, each call made by the next key in turn: an
    object one key made is never read, listed, continued or deleted by another (404), unless that
    key is an operator."""
    machine = keyed_schema.as_state_machine()
    owners = Owners()
    order = [*OWNERS, "alice", "alice", "bob", "bob"]  # links followed by the same key, and by another

    class Sequences(machine):  # type: ignore[misc, valid-type]
        turn = 0  # per sequence: the same steps get the same keys when hypothesis replays one

        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            self.turn += 1
            self.who = order[self.turn % len(order)]
            return {"base_url": shared.base_url, "timeout": 30, "headers": headers_of(self.who)}

        def validate_response(self, response: Any, case: schemathesis.Case, **kwargs: Any) -> None:
            try:  # kept, not raised: a replay against a gateway whose objects changed is not the same run
                _check(case, response)
            except AssertionError as exc:
                owners.failed.append(str(exc))
            media = (response.headers.get("content-type") or [""])[0]
            body = response.json() if media.split(";")[0].strip() == "application/json" else None  # not jsonl
            owners.saw(self.who, case, response.status_code, body)

    Sequences.run(
        settings=settings(
            max_examples=max(2, EXAMPLES // 2),
            stateful_step_count=6,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
    )
    assert not owners.failed, owners.failed[:5]
    assert owners.owner, owners.owner  # objects made
    # every object the sequences made, asked for by another key that is no operator (whether the
    # sequences themselves crossed owners depends on their draws): a 404, never the object
    for oid, maker in owners.owner.items():
        route = next(
            r
            for prefix, r in (("file-", "files"), ("batch_", "batches"), ("resp_", "responses"))
            if oid.startswith(prefix)
        )
        other = next(k for k in ("alice", "bob", "narrow") if k != maker)
        r = httpx.get(f"{shared.base_url}/v1/{route}/{quote(oid, safe='')}", headers=headers_of(other), timeout=30)
        owners.tried += 1
        assert r.status_code == 404, (oid, maker, other, r.status_code, r.text[:300])
    assert not owners.crossed, owners.crossed[:10]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
ADMIN_CALLS = st.sampled_from(
    [
        ("POST", "/admin/keys"),
        ("GET", "/admin/keys"),
        ("DELETE", "/admin/keys/{name}"),
        ("POST", "/admin/keys/{name}/rotate"),
        ("GET", "/admin/spend"),
    ]
)


@given(
    call=ADMIN_CALLS,
    who=st.sampled_from([*OWNERS, "admin", "none"]),
    name=st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True) | st.text(max_size=30),
    body=JSON | st.fixed_dictionaries({"name": st.text(max_size=70)}, optional={"models": JSON, "limits": JSON}),
)
@settings(max_examples=EXAMPLES * 4, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_admin_api_under_any_key_and_body(
    shared: Gateway, call: tuple[str, str], who: str, name: str, body: Any
) -> None:
    """Only the admin key opens /admin (401 otherwise); any body gets a 2xx or a 4xx in the API's shape."""
    method, path = call
    headers = headers_of(who) if who != "none" else {}
    url = path.replace("{name}", quote(name, safe="") or "x")
    with shared.http() as http:
        resp = http.request(method, url, json=body if method == "POST" else None, headers=headers)
    assert resp.status_code < 500, (method, url, body, resp.text[:300])
    if who != "admin":
        assert resp.status_code in (401, 404), (who, method, url, resp.status_code)
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), resp.text[:300]


# --- hostile JSON schemas against the in-process engine -----------------------------------------------------

COUNTS = st.sampled_from([0, 1, 2, 999, 1000, 1024, 2000, 4096, 4097, 10_000, 1_000_000]) | st.integers(0, 5000)
PATTERNS = st.sampled_from(
    [
        "^[a-z]+$",
        "^(ab){2,1500}$",
        "^x{0,5000}$",
        "^[0-9]{3}-[0-9]{4}$",
        "((a|b)*c)+",
        "^.{900}$",
        "^\\d+$",
        "^[a-z\\-.]+@x\\.org$",
        "^\\w{2,}\\s?$",
    ]
)
LEAVES = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "minLength": COUNTS,
            "maxLength": COUNTS,
            "pattern": PATTERNS,
            "format": st.sampled_from(["date", "date-time", "time", "uuid", "email"]),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={"minimum": st.integers(-(10**12), 10**12), "maximum": st.integers(-(10**12), 10**12)},
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda v: {"enum": v}, st.lists(st.text(max_size=30) | st.integers(), min_size=1, max_size=300)),
    st.builds(lambda v: {"const": v}, st.text(max_size=50)),
)
SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": inner},
            optional={"minItems": COUNTS, "maxItems": COUNTS, "uniqueItems": st.booleans()},
        ),
        st.builds(
            lambda props, extra: {"type": "object", "properties": props, "required": sorted(props)[:2], **extra},
            st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), inner, min_size=1, max_size=6),
            st.fixed_dictionaries(
                {},
                optional={
                    "additionalProperties": st.booleans() | inner,
                    "minProperties": COUNTS,
                    "maxProperties": COUNTS,
                },
            ),
        ),
        st.builds(
            lambda k, v: {k: v}, st.sampled_from(["anyOf", "oneOf", "allOf"]), st.lists(inner, min_size=1, max_size=4)
        ),
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
@lanes.engine
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from tests.backends.test_engines import POLICY

    runner = GatewayRunner(tmp_path_factory.mktemp("fuzz-engine"))
    yield runner.start(POLICY)
    runner.stop_all()


@given(schema=SCHEMAS, surface=st.integers(0, 2))
@settings(max_examples=HOSTILE, deadline=None, suppress_health_check=list(HealthCheck))
def test_hostile_schemas_never_reach_the_engine_in_a_form_that_kills_it(
    engine: Gateway, schema: dict[str, Any], surface: int
) -> None:
    """Any JSON schema on any of the three surfaces: served (200) or refused (400 naming the
    field), or past the request's deadline (504: a grammar slow to sample; the job is stopped);
    never a crash (502, a restart of the engine's worker)."""
    from tests.backends.test_engines import host_of, surfaces

    host = host_of(engine)
    restarts = host.restarts
    path, body = surfaces(schema)[surface]
    with engine.http() as http:
        resp = http.post(path, json={**body, **({"max_tokens": 2} if "max_tokens" in body else {})})
    assert resp.status_code in (200, 400, 504), (path, schema, resp.status_code, resp.text[:300])
    if resp.status_code != 504:  # a job that hangs past its deadline is ended by a restart, by design
        assert host.restarts == restarts, (path, schema)


def test_the_module_fuzzes_every_operation() -> None:
    assert len(list(schema.get_all_operations())) == sum(len(v) for v in document("t", "0", False)["paths"].values())
    assert len(list(keyed_schema.get_all_operations())) == len(list(schema.get_all_operations()))
    assert Path(__file__).name == "test_fuzz.py"


def test_stateful_sequences_follow_the_links(fuzzed: Gateway) -> None:
    """Sequences that follow the document's links (a file uploaded, then read, used by a batch,
    the batch read and cancelled, the file deleted; a stored response read and deleted): no 500 and
    every error in the API's shape at any step."""
    machine = schema.as_state_machine()

    class Sequences(machine):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"base_url": fuzzed.base_url, "timeout": 30}

        def validate_response(self, response: Any, case: schemathesis.Case, **kwargs: Any) -> None:
            _check(case, response)
            seen.add((case.method, case.path, response.status_code))

    seen: set[tuple[str, str, int]] = set()
    Sequences.run(
        settings=settings(
            max_examples=max(2, EXAMPLES // 2),
            stateful_step_count=6,
            deadline=None,
            derandomize=True,  # the same sequences every run: what is asserted below does not flake
            suppress_health_check=list(HealthCheck),
        )
    )
    followed = {(m, p) for m, p, status in seen if status == 200}
    linked = {("GET", "/v1/files/{file_id}"), ("GET", "/v1/files/{file_id}/content"), ("DELETE", "/v1/files/{file_id}")}
    assert ("POST", "/v1/files") in followed and followed & linked, sorted(seen)  # an upload's id was followed
