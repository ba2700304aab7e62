"""Roles on the admin API and the console (issue 55, part 2), against a real uvicorn gateway: each
role's allowed and refused actions as the one table (``policies/roles.py``) says, a team admin
kept to its own team's keys, teams and spend, nobody giving a key more than its own role, and every
call by a principal, allowed or refused, in the audit log with who, what, when and from where. The
console is driven in Debian's headless Chromium for a viewer and a team admin."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from gateway.http import console_auth
from policies.roles import ACTIONS, TABLE, Principal, decide
from policies.schema_access import ROLES
from tests import lanes
from tests.browser import chromium, chromium_path
from tests.conftest import Gateway

if TYPE_CHECKING:
    from playwright.sync_api import Browser

ADMIN, OPERATOR, VIEWER, RED_ADMIN = "sk-admin-r", "sk-operator-r", "sk-viewer-r", "sk-red-admin-r"
RED_APP, BLUE_APP = "sk-red-app", "sk-blue-app"
CREDENTIALS = {"admin": ADMIN, "operator": OPERATOR, "viewer": VIEWER, "team_admin": RED_ADMIN}
MSG = [{"role": "user", "content": "hi"}]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


POLICY = f"""version: 1
backends:
  say: {{type: scripted, text: "ok"}}
models:
  m: {{backend: say, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
  other: {{backend: say}}
teams:
  red: {{models: [m], limits: {{rpm: 100, budget_per_day: 5}}}}
  blue: {{}}
keys:
  - {{name: ops, sha256: "{sha(OPERATOR)}", role: operator}}
  - {{name: look, sha256: "{sha(VIEWER)}", role: viewer}}
  - {{name: red-lead, sha256: "{sha(RED_ADMIN)}", role: team_admin, team: red}}
  - {{name: red-app, sha256: "{sha(RED_APP)}", team: red, user: ada}}
  - {{name: blue-app, sha256: "{sha(BLUE_APP)}", team: blue}}
access: {{admin_key: "{sha(ADMIN)}"}}
"""


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(console_auth.SECRET_ENV, "roles-test-secret")
    console_auth.secret.cache_clear()
    yield
    console_auth.secret.cache_clear()


def call(gw: Gateway, key: str, method: str, path: str, body: object = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "user-agent": "roles-test"}
    return httpx.request(method, gw.base_url + path, json=body, headers=headers, timeout=30)


# one request per action of the table: (method, path, body), made for a role (names kept apart)
def requests_for(role: str) -> dict[str, tuple[str, str, Any]]:
    return {
        "keys.read": ("GET", "/admin/keys", None),
        "keys.write": ("POST", "/admin/keys", {"name": f"made-by-{role}", "team": "red", "models": ["m"]}),
        "teams.read": ("GET", "/admin/teams", None),
        "teams.write": ("POST", "/admin/teams", {"name": f"team-of-{role}", "limits": {"rpm": 10}}),
        "spend.read": ("GET", "/admin/spend", None),
        "audit.read": ("GET", "/admin/audit", None),
        "traffic.read": ("GET", "/admin/whoami", None),  # no admin route of its own: the console's (below)
        "quality.read": ("GET", "/admin/quality", None),
        "policy.reload": ("POST", "/admin/reload", None),
    }


def test_each_role_may_do_what_the_table_says_and_no_more(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(POLICY)
    assert set(requests_for("x")) == set(ACTIONS)
    for role, key in CREDENTIALS.items():
        who = Principal(role, role, "red" if role == "team_admin" else None)  # type: ignore[arg-type]
        for action, (method, path, body) in requests_for(role).items():
            if action == "traffic.read":
                continue
            r = call(gw, key, method, path, body)
            if decide(who, action).allowed:  # allowed: not refused (quality: no `quality` section, a 404)
                assert r.status_code in (200, 201, 404), (role, action, r.status_code, r.text)
            else:
                assert r.status_code == 403, (role, action, r.status_code, r.text)
                assert r.json()["error"]["code"] == "permission_denied", (role, action)
    me = call(gw, RED_ADMIN, "GET", "/admin/whoami").json()
    assert me["role"] == "team_admin" and me["team"] == "red" and me["actions"]["keys.write"] == "team"
    for key in (RED_APP, "sk-nobody"):  # a key without a role, or none: not an admin credential
        r = call(gw, key, "GET", "/admin/keys")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and key not in r.text


def test_a_team_admin_acts_only_on_its_own_team(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(POLICY)
    listed = {k["name"] for k in call(gw, RED_ADMIN, "GET", "/admin/keys").json()["data"]}
    assert listed == {"red-lead", "red-app"}
    assert [t["name"] for t in call(gw, RED_ADMIN, "GET", "/admin/teams").json()["data"]] == ["red"]
    made = call(gw, RED_ADMIN, "POST", "/admin/keys", {"name": "red-2", "user": "bo"})  # its team by default
    assert made.status_code == 201 and made.json()["team"] == "red"
    assert openai.OpenAI(base_url=gw.base_url + "/v1", api_key=made.json()["key"], max_retries=0).models.list()
    for body in (
        {"name": "blue-2", "team": "blue"},  # another team
        {"name": "red-3", "role": "viewer"},  # a role: more than it may give
    ):
        r = call(gw, RED_ADMIN, "POST", "/admin/keys", body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", (body, r.text)
    over = call(gw, RED_ADMIN, "POST", "/admin/keys", {"name": "red-4", "limits": {"rpm": 1000}})
    assert over.status_code == 400 and "over the team's" in over.json()["error"]["message"]  # within the team's
    other = call(gw, ADMIN, "POST", "/admin/keys", {"name": "blue-3", "team": "blue"}).json()
    assert call(gw, RED_ADMIN, "DELETE", "/admin/keys/blue-3").status_code == 403
    assert call(gw, RED_ADMIN, "POST", "/admin/keys/blue-3/rotate").status_code == 403
    assert call(gw, RED_ADMIN, "DELETE", "/admin/keys/red-2").status_code == 200
    assert call(gw, RED_ADMIN, "GET", "/admin/spend?team=blue").status_code == 403
    assert call(gw, RED_ADMIN, "GET", "/admin/spend?key=blue-app").status_code == 403
    assert call(gw, RED_ADMIN, "GET", "/admin/spend").json()["team"]["team"] == "red"
    assert call(gw, other["key"], "GET", "/v1/models").status_code == 200  # the key it could not revoke still works
    # an operator may make keys with the roles below its own, not an operator or an admin
    assert call(gw, OPERATOR, "POST", "/admin/keys", {"name": "v2", "role": "viewer"}).status_code == 201
    assert call(gw, OPERATOR, "POST", "/admin/keys", {"name": "o2", "role": "operator"}).status_code == 403
    admin2 = call(gw, ADMIN, "POST", "/admin/keys", {"name": "a2", "role": "admin"}).json()["key"]
    assert call(gw, admin2, "GET", "/admin/audit").status_code == 200  # a key made with a role acts with it


def test_every_admin_action_is_in_the_audit_log(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(POLICY)
    call(gw, OPERATOR, "POST", "/admin/teams", {"name": "green"})
    call(gw, VIEWER, "POST", "/admin/teams", {"name": "grey"})
    call(gw, "sk-nobody", "POST", "/admin/teams", {"name": "nope"})  # no credential: logged, not audited
    call(gw, RED_ADMIN, "DELETE", "/admin/keys/nope")  # allowed by role, failed: 404
    audit = call(gw, ADMIN, "GET", "/admin/audit").json()["data"]
    rows = [(e["who"], e["role"], e["action"], e["target"], e["outcome"], e["status"]) for e in audit]
    assert rows == [
        ("red-lead", "team_admin", "keys.write", "key:nope", "failed", 404),
        ("look", "viewer", "teams.write", "", "refused", 403),
        ("ops", "operator", "teams.write", "team:green", "allowed", 201),
    ], rows
    first = audit[-1]
    assert first["client"] == "127.0.0.1" and first["agent"] == "roles-test" and first["surface"] == "api"
    assert first["via"] == "key" and first["gateway"] and abs(first["at"] - audit[0]["at"]) < 60
    assert "the role viewer may not do teams.write" in audit[1]["note"]
    assert all(ADMIN not in str(e) and OPERATOR not in str(e) for e in audit)  # no secret in the log


def test_the_table_covers_every_role_and_the_admin_may_do_everything() -> None:
    admin = Principal("admin", "admin")
    assert all(decide(admin, a).allowed for a in ACTIONS)
    assert all(set(by) <= set(ROLES) for by in TABLE.values())
    viewer = Principal("v", "viewer")
    assert not any(decide(viewer, a).allowed for a in ACTIONS if a.endswith(".write") or a == "policy.reload")
    lead = Principal("l", "team_admin", "red")
    assert decide(lead, "keys.write", "red").allowed and not decide(lead, "keys.write", "blue").allowed
    assert not decide(Principal("x", "team_admin"), "keys.read").allowed  # a team admin without a team: nothing


# -- the console, in a browser --------------------------------------------------------------------


@pytest.fixture(scope="module")
@lanes.fleet
def browser() -> Iterator[Browser]:
    if chromium_path() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no chromium: `make services` installs it")
        pytest.skip("no chromium on PATH: `make services` installs Debian's")
    with chromium() as b:
        yield b


def test_in_a_browser_each_role_sees_and_does_what_it_may(gateway: Callable[..., Gateway], browser: Browser) -> None:
    gw = gateway(POLICY)
    assert call(gw, ADMIN, "POST", "/admin/keys", {"name": "blue-9", "team": "blue"}).status_code == 201

    def session(key: str) -> Any:
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(gw.base_url + "/console/keys")
        page.get_by_label("Admin key").fill(key)
        page.get_by_role("button", name="Log in").click()
        page.get_by_role("heading", name=re.compile("^Keys and spend")).wait_for()
        return page

    viewer = session(VIEWER)  # reads keys and spend; no form, no audit log
    nav = viewer.get_by_role("navigation").inner_text()
    assert "Keys and spend" in nav and "Audit log" not in nav and "Traffic" in nav
    assert viewer.get_by_role("button", name="Make the key").count() == 0
    assert viewer.get_by_role("button", name=re.compile("^Revoke")).count() == 0
    assert viewer.locator('tr[data-key="blue-9"]').count() == 1
    assert viewer.locator(".who").inner_text() == "look (viewer)"
    refused = viewer.goto(gw.base_url + "/console/audit")
    assert refused is not None and refused.status == 403
    assert "the role viewer may not do audit.read" in viewer.get_by_role("alert").inner_text()
    viewer.close()

    lead = session(RED_ADMIN)  # its own team's keys only, and makes keys in it
    nav = lead.get_by_role("navigation").inner_text()
    assert "Traffic" not in nav and "Audit log" not in nav and "Teams" in nav
    assert lead.locator('tr[data-key="blue-9"]').count() == 0 and lead.locator('tr[data-key="red-app"]').count() == 1
    lead.get_by_label("Name", exact=True).fill("red-from-browser")
    lead.get_by_label("User (empty: none)").fill("cy")
    assert lead.get_by_label("Role").count() == 0  # it gives no role
    lead.get_by_role("button", name="Make the key").click()
    secret = lead.get_by_label("Key", exact=True).input_value()
    row = lead.locator('tr[data-key="red-from-browser"]').inner_text()
    assert "red" in row and "cy" in row
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):  # its team's models: m only
        client.chat.completions.create(model="other", messages=MSG)
    assert client.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "ok"
    page = lead.goto(gw.base_url + "/console")
    assert page is not None and page.status == 403
    lead.close()

    operator = session(OPERATOR)  # sees the audit log: the team admin's key, from the console
    operator.get_by_role("link", name="Audit log").click()
    rows = operator.locator("#audit-table tbody tr")
    assert "console.login" in rows.first.inner_text() and "ops" in rows.first.inner_text()  # its own login, newest
    made = rows.filter(has_text="key:red-from-browser").inner_text()
    assert "red-lead" in made and "keys.write" in made and "allowed 201" in made and "console" in made
    operator.close()


def test_the_docs_show_the_table_as_it_is() -> None:
    from pathlib import Path

    from policies.roles import table_rows

    doc = (Path(__file__).resolve().parents[2] / "docs" / "tenancy.md").read_text()
    for action, by in table_rows():
        assert f"| `{action}` | " + " | ".join(by[r] for r in ROLES) + " |" in doc, action
