"""The operator's console (issue 34): its login and sessions, its refusals, its pages' contents, and
what a person does in it, in a real headless Chromium (Debian's, through playwright) against a real
uvicorn: log in, see a request made by the official client appear within 2 s, open its trace, make
and revoke a key and see the revoked key refused. No page shows a key or a prompt unless the
policy logs prompts."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from gateway.http import console_auth
from tests import lanes
from tests.browser import chromium, chromium_path
from tests.conftest import Gateway

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

ADMIN = "sk-admin-console"
APP = "sk-app-console"
PROMPT = "the secret plans of the penguins"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(log_prompts: bool = False, admin: bool = True, extra: str = "", threshold: float = 0.9) -> str:
    return f"""version: 1
backends:
  cheap_b: {{type: scripted, text: "A"}}
  top_b: {{type: scripted, text: "B"}}
models:
  cheap: {{backend: cheap_b, prices: {{input_per_mtok: 1, output_per_mtok: 1}}}}
  top: {{backend: top_b, prices: {{input_per_mtok: 1000, output_per_mtok: 1000}}}}
virtual_models:
  auto: {{type: cascade, open: cheap}}
cascade:
  tiers:
    - {{name: small, type: model, model: cheap, logprobs: false, assumed_confidence: 0.3,
       thresholds: {{choice: {threshold}}}}}
    - {{name: big, type: model, model: top, logprobs: false}}
keys:
  - {{name: app, sha256: "{sha(APP)}"}}
{f'access: {{admin_key: "{sha(ADMIN)}"}}' if admin else ""}
logging: {{log_prompts: {str(log_prompts).lower()}}}
console: {{reports: reports}}
{extra}"""


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(console_auth.SECRET_ENV, "console-test-secret")
    console_auth.secret.cache_clear()
    yield
    console_auth.secret.cache_clear()


def origin(gw: Gateway) -> dict[str, str]:
    return {"origin": gw.base_url}


@contextmanager
def logged_in(gw: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw.base_url, timeout=30, follow_redirects=False) as http:
        r = http.post("/console/login", data={"key": ADMIN, "next": "/console"}, headers=origin(gw))
        assert r.status_code == 303 and r.headers["location"] == "/console", r.text
        yield http


def csrf(http: httpx.Client, path: str = "/console/keys") -> str:
    page = http.get(path).text
    return page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


# -- the login and its refusals ---------------------------------------------------------------------


def test_no_admin_key_no_console(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(admin=False))
    for path in ("/console", "/console/login", "/console/api/traffic"):
        r = httpx.get(gw.base_url + path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", path


def test_without_a_session_pages_go_to_the_login_and_json_is_a_401(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with httpx.Client(base_url=gw.base_url) as http:
        r = http.get("/console/decisions?x=1")
        assert r.status_code == 303 and r.headers["location"] == "/console/login?next=%2Fconsole%2Fdecisions%3Fx%3D1"
        r = http.get("/console/api/traffic")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        login = http.get("/console/login")
        assert login.status_code == 200 and '<label for="key">Admin key</label>' in login.text
        assert "frame-ancestors 'none'" in login.headers["content-security-policy"]


def test_the_login_sets_a_strict_http_only_cookie_and_refuses_a_wrong_key(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with httpx.Client(base_url=gw.base_url) as http:
        wrong = http.post("/console/login", data={"key": "sk-guess"}, headers=origin(gw))
        assert wrong.status_code == 401 and "That is not the admin key." in wrong.text
        assert console_auth.COOKIE not in wrong.cookies
        r = http.post("/console/login", data={"key": ADMIN, "next": "https://evil.example/"}, headers=origin(gw))
        assert r.status_code == 303 and r.headers["location"] == "/console"  # never off the console
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
        assert ADMIN not in cookie and sha(ADMIN) not in cookie and ADMIN not in r.headers["location"]
        assert http.get("/console").status_code == 200


def test_a_forged_altered_or_expired_cookie_is_no_session(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    key = console_auth.secret()
    good, _ = console_auth.issue(key, sha(ADMIN), 600)
    expired, _ = console_auth.issue(key, sha(ADMIN), 600, now=time.time() - 3600)
    forged, _ = console_auth.issue(b"x" * 32, sha(ADMIN), 600)
    other_admin, _ = console_auth.issue(key, sha("sk-old-admin"), 600)
    stamp, nonce, sig = good.split(".")
    longer = f"{int(stamp) + 86400}.{nonce}.{sig}"
    for value, ok in [(good, True), (expired, False), (forged, False), (other_admin, False), (longer, False)]:
        r = httpx.get(gw.base_url + "/console/api/traffic", cookies={console_auth.COOKIE: value})
        assert r.status_code == (200 if ok else 401), value


def test_cross_site_writes_are_refused(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with logged_in(gw) as http:
        cross_site(gw, http)


def cross_site(gw: Gateway, http: httpx.Client) -> None:
    token = csrf(http)
    form = {"name": "evil", "csrf": token}
    assert http.post("/console/keys", data=form, headers={"origin": "https://evil.example"}).status_code == 403
    assert http.post("/console/keys", data=form).status_code == 403  # neither Origin nor Referer
    assert http.post("/console/keys", data={"name": "evil"}, headers=origin(gw)).status_code == 403  # no token
    bad = {"name": "evil", "csrf": "0" * 32}
    assert http.post("/console/keys", data=bad, headers=origin(gw)).status_code == 403
    login = {"key": ADMIN}
    assert httpx.post(gw.base_url + "/console/login", data=login, headers={"origin": "http://evil"}).status_code == 403
    names = [k["name"] for k in admin_keys(gw)]
    assert "evil" not in names
    ok = http.post("/console/keys", data={"name": "fine", "csrf": token}, headers={"referer": gw.base_url + "/x"})
    assert ok.status_code == 201


def admin_keys(gw: Gateway) -> list[dict]:
    r = httpx.get(gw.base_url + "/admin/keys", headers={"authorization": f"Bearer {ADMIN}"})
    return r.json()["data"]


# -- what the pages show ----------------------------------------------------------------------------


def decide(gw: Gateway, rid: str) -> httpx.Response:
    body = {"question": PROMPT, "type": "choice", "options": ["first", "second"]}
    r = httpx.post(
        gw.base_url + "/v1/decide", json=body, headers={"authorization": f"Bearer {APP}", "x-request-id": rid}
    )
    assert r.status_code == 200, r.text
    return r


def test_the_trace_shows_tiers_thresholds_and_cost_and_no_prompt(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    decide(gw, "rq-decide-1")
    with logged_in(gw) as http:
        trace_page(http)


def trace_page(http: httpx.Client) -> None:
    page = http.get("/console/requests/rq-decide-1").text
    assert (
        "<strong>big</strong>" in page and "escalated" in page and "<td>0.9</td>" in page
    )  # the first tier's threshold
    assert PROMPT not in page and ADMIN not in page and APP not in page
    decisions = http.get("/console/decisions").text
    assert "below its threshold" in decisions and "choice: 1 answered" in decisions
    # always top: the top tier was asked, so it cost what it cost; the cheap tier's cost is the overhead
    traffic = http.get("/console/api/traffic").json()
    assert traffic["all"]["requests"] >= 1 and traffic["latest"][0]["request_id"] == "rq-decide-1"
    assert http.get("/console/requests/no-such-id").status_code == 404


def test_with_log_prompts_the_trace_shows_the_prompt_and_answers(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(log_prompts=True))
    decide(gw, "rq-shown")
    with logged_in(gw) as http:
        page = http.get("/console/requests/rq-shown").text
    assert PROMPT in page and "(not shown)" not in page


def test_reports_are_listed_and_nothing_outside_their_folder_is_served(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    reports = gw.policy_path.parent / "reports"
    reports.mkdir()
    (reports / "eval-boolq.json").write_text(json.dumps({"sets": {"boolq": {"accuracy": 0.81}}}))
    (reports / "notes.exe").write_text("no")
    with logged_in(gw) as http:
        listing = http.get("/console/reports").text
        assert "eval-boolq.json" in listing and "notes.exe" not in listing
        shown = http.get("/console/reports/eval-boolq.json").text
        assert "sets.boolq.accuracy" in shown and "0.81" in shown
        bad_paths(http)


def bad_paths(http: httpx.Client) -> None:
    for bad in (
        "/console/reports/../policy-0.yaml",
        "/console/reports/%2e%2e/policy-0.yaml",
        "/console/reports/notes.exe",
    ):
        assert http.get(bad).status_code == 404, bad


def test_the_batches_page_lists_a_batch_with_its_prefix_groups(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(policy())
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "cheap", "messages": [{"role": "user", "content": f"q{i}"}]},
        }
        for i in range(3)
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    client = gw.client(APP)
    with path.open("rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    deadline = time.monotonic() + 30
    while client.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with logged_in(gw) as http:
        page = http.get("/console/batches").text
    row = page.split(batch.id, 1)[1].split("</tr>", 1)[0]
    assert "completed" in row and "<td>3</td>" in row


def test_a_console_session_is_not_an_api_key(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with logged_in(gw) as http:
        cookie = http.cookies.get(console_auth.COOKIE)
    r = httpx.get(gw.base_url + "/admin/keys", cookies={console_auth.COOKIE: cookie or ""})
    assert r.status_code == 401


# -- in a real browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
@lanes.fleet
def browser() -> Iterator[Browser]:
    """Debian's headless Chromium (``make services`` installs it; missing: a skip, in CI a failure)."""
    if chromium_path() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no chromium: `make services` installs it")
        pytest.skip("no chromium on PATH: `make services` installs Debian's")
    with chromium() as b:
        yield b


def log_in(page: Page, gw: Gateway, key: str = ADMIN) -> None:
    page.goto(gw.base_url + "/console")
    assert "/console/login" in page.url
    page.get_by_label("Admin key").fill(key)
    page.get_by_role("button", name="Log in").click()


def test_in_a_browser_a_request_appears_live_and_its_trace_opens(
    gateway: Callable[..., Gateway], browser: Browser
) -> None:
    gw = gateway(policy())
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    log_in(page, gw, "sk-wrong")
    page.get_by_role("alert").filter(has_text="That is not the admin key.").wait_for()
    log_in(page, gw)
    page.get_by_role("heading", name="Traffic").wait_for()
    raw = gw.client(APP).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": PROMPT}]
    )
    rid = raw.headers["x-request-id"]
    seen = time.monotonic()
    link = page.get_by_role("link", name=rid)
    link.wait_for(timeout=2000)  # the page polls every second: at most 2 s behind
    assert time.monotonic() - seen < 2.0
    link.click()
    page.get_by_role("heading", name=f"Request {rid}").wait_for()
    assert page.locator("#served").inner_text() == "cheap"
    html = page.content()
    assert PROMPT not in html and ADMIN not in html and APP not in html
    page.close()


def test_in_a_browser_a_key_made_works_and_once_revoked_is_refused(
    gateway: Callable[..., Gateway], browser: Browser
) -> None:
    gw = gateway(policy())
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    log_in(page, gw)
    page.get_by_role("link", name="Keys and spend").click()
    page.get_by_label("Name", exact=True).fill("made-in-browser")
    page.get_by_label("Models (comma-separated; empty: all)").fill("auto")
    page.get_by_label("Requests per minute").fill("600")
    page.get_by_label("Budget per UTC day").fill("2.5")
    page.get_by_role("button", name="Make the key").click()
    secret = page.get_by_label("Key", exact=True).input_value()
    assert secret.startswith("sk-triage-")
    made = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=secret, max_retries=0)
    assert made.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}]).choices
    page.get_by_role("link", name="Keys and spend").click()
    assert secret not in page.content()  # shown once, at creation
    row = page.locator('tr[data-key="made-in-browser"]').inner_text()
    assert "rpm 600" in row and "budget_per_day 2.5" in row and "auto" in row
    page.get_by_role("button", name="Revoke made-in-browser").click()
    page.locator('tr[data-key="made-in-browser"]').filter(has_text="revoked").wait_for()
    deadline = time.monotonic() + 5
    while True:
        try:
            made.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}])
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "the revoked key still works"
        time.sleep(0.1)
    made.close()
    page.close()


def test_in_a_browser_every_page_is_labelled_and_fits_a_phone(
    gateway: Callable[..., Gateway], browser: Browser
) -> None:
    gw = gateway(policy())
    decide(gw, "rq-phone")
    for width, height in ((1280, 800), (390, 844)):
        page = browser.new_page(viewport={"width": width, "height": height})
        log_in(page, gw)
        for path in (
            "/console",
            "/console/decisions",
            "/console/requests",
            "/console/requests/rq-phone",
            "/console/keys",
            "/console/batches",
            "/console/reports",
        ):
            page.goto(gw.base_url + path)
            unlabelled = page.evaluate(
                """() => [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]
                    .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')).map(e => e.name)"""
            )
            assert unlabelled == [], (path, unlabelled)
            overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, (path, width, overflow)  # wide tables scroll in their own box
            assert page.locator("main h1").count() == 1, path
        page.keyboard.press("Tab")  # the first stop is the skip link
        assert page.evaluate("() => document.activeElement.textContent") == "Skip to content"
        page.close()


def test_the_decisions_page_shows_the_quality_watch_where_there_is_one(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(extra="quality: {path: quality.sqlite3, target: 0.8, min_pairs: 1, check_every_s: 0.1}\n"))
    for i in range(3):
        decide(gw, f"rq-q{i}")
    with logged_in(gw) as http:
        page = http.get("/console/decisions").text
    table = page.split('id="quality-table"', 1)[1].split("</table>", 1)[0]
    assert "<td>cascade</td>" in table and "<td>3</td>" in table  # three records of the cascade


def test_the_ring_keeps_the_last_requests_and_reads_a_window() -> None:
    from gateway.obs.recent import Recent, Seen, percentile, traffic

    clock = [1000.0]
    ring = Recent(size=100, now=lambda: clock[0])
    for i in range(150):
        clock[0] = 1000.0 + i
        ring.add(Seen(f"r{i}", clock[0], "chat", "m", "m", 500 if i % 10 == 0 else 200, float(i % 7)))
    assert ring.find("r49") is None and ring.find("r50") is not None and ring.total == 150
    t = traffic(ring, window_s=60)
    assert t["all"]["requests"] == 60 and t["all"]["server_errors"] == 6  # r90..r149
    assert sum(t["per_second"]) == 60 and t["latest"][0]["request_id"] == "r149"
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and percentile([], 0.5) is None
    ring.add(Seen("r60", 2000.0, "chat", "m", "m", 200, 1.0))  # an id sent again: the last one is kept
    assert ring.find("r60").at == 2000.0 and ring.latest(1)[0].request_id == "r60"


def test_bad_key_forms_get_an_error_on_the_page_and_make_nothing(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with logged_in(gw) as http:
        token = csrf(http)
        for form, status, says in [
            ({"name": "bad name!"}, 400, "a name is 1 to 64"),
            ({"name": "ok1", "rpm": "lots"}, 400, "limits:"),
            ({"name": "ok2", "rpm": "0"}, 400, "limits:"),
            ({"name": "ok3", "models": "no-such-model"}, 400, "no model named no-such-model"),
            ({"name": "app"}, 409, "is a key of the policy"),
        ]:
            r = http.post("/console/keys", data={**form, "csrf": token}, headers=origin(gw))
            assert r.status_code == status and says in r.text, (form, r.status_code)
        r = http.post("/console/keys/nobody/revoke", data={"csrf": token}, headers=origin(gw))
        assert r.status_code == 404 and "no live key named" in r.text
        r = http.post("/console/keys/nobody/rotate", data={"csrf": token, "grace_s": "-1"}, headers=origin(gw))
        assert r.status_code == 400
    assert [k["name"] for k in admin_keys(gw)] == ["app"]
