"""Signed tokens from a real identity provider (issue 55, part 3): `oauth2-mock-server` (npm, an
OAuth 2 / OpenID Connect server for tests; `make services` installs it into .venv-idp/ where Node
is on the machine) started by the test on a loopback port, with keys it makes itself. Its token
endpoint issues the tokens; the gateway reads its JWKS; a key it adds later (a rotation) is picked
up without a restart; a token it signs for another audience is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests import lanes
from tests.conftest import Gateway
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
MODULE = Path(os.environ.get("TRIAGE_IDP_DIR", ROOT / ".venv-idp")) / "node_modules/oauth2-mock-server/dist/index.mjs"
MSG = [{"role": "user", "content": "hi"}]
CLAIMS = "{aud: 'triage', team: 'research', email: 'ada@lab.test', groups: ['triage-operators']}"
SCRIPT = """
import {{ OAuth2Server }} from '{module}';
import readline from 'node:readline';
const server = new OAuth2Server();
await server.issuer.keys.generate('RS256', {{ kid: 'first' }});
server.service.on('beforeTokenSigning', (token) => {{ Object.assign(token.payload, {claims}); }});
await server.start({port}, '127.0.0.1');
console.log('ready ' + server.issuer.url);
readline.createInterface({{ input: process.stdin }}).on('line', async (line) => {{
  const [command, kid, aud] = line.split(' ');
  if (command === 'rotate') {{
    await server.issuer.keys.generate('ES256', {{ kid }});
    console.log('rotated ' + kid);
  }} else if (command === 'token') {{
    const transform = (header, payload) => {{ Object.assign(payload, {claims}, {{ aud }}); }};
    console.log('token ' + await server.issuer.buildToken({{ kid, scopesOrTransform: transform }}));
  }}
}});
"""


@dataclass
class Provider:
    proc: subprocess.Popen[str]
    port: int
    issuer: str

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip().split(" ", 1)[1]

    def issued(self) -> str:
        """A token from the provider's own token endpoint (the client credentials grant)."""
        form = {"grant_type": "client_credentials", "client_id": "triage-tests", "scope": "chat"}
        r = httpx.post(f"http://127.0.0.1:{self.port}/token", data=form, timeout=10)
        assert r.status_code == 200, r.text
        return str(r.json()["access_token"])


@pytest.fixture
@lanes.fleet
def provider(tmp_path: Path) -> Iterator[Provider]:
    node = shutil.which("node")
    if node is None or not MODULE.exists():
        reason = "no node, or oauth2-mock-server is not in .venv-idp/: `make services` installs it"
        if os.environ.get("CI") == "true" and node is not None:
            pytest.fail(reason)
        pytest.skip(reason)
    port = free_port()
    script = tmp_path / "idp.mjs"
    script.write_text(SCRIPT.format(module=MODULE.as_uri(), claims=CLAIMS, port=port))
    with subprocess.Popen([node, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            ready = proc.stdout.readline().strip()
            assert ready.startswith("ready "), f"the provider did not start: {ready!r}"
            yield Provider(proc, port, ready.split(" ", 1)[1])
        finally:
            proc.terminate()
            proc.wait(10)


def policy(idp: Provider) -> str:
    return f"""version: 1
backends:
  say: {{type: scripted, text: "ok"}}
models:
  m: {{backend: say}}
  other: {{backend: say}}
teams:
  research: {{models: [m]}}
access:
  tokens:
    jwks_url: "http://127.0.0.1:{idp.port}/jwks"
    issuer: "{idp.issuer}"
    audience: triage
    claims: {{user: email, team: team, role: groups}}
    roles: {{triage-operators: operator}}
    algorithms: [RS256, ES256]
    min_refresh_s: 0
"""


def test_tokens_from_a_real_provider_and_its_rotated_keys(gateway: Callable[..., Gateway], provider: Provider) -> None:
    gw = gateway(policy(provider))
    token = provider.issued()
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=token, max_retries=0)
    assert client.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "ok"
    with pytest.raises(openai.PermissionDeniedError):  # the team's models: m only
        client.chat.completions.create(model="other", messages=MSG)
    me = httpx.get(gw.base_url + "/admin/whoami", headers={"authorization": f"Bearer {token}"}).json()
    assert (me["name"], me["role"], me["team"]) == ("jwt:ada@lab.test", "operator", "research")

    elsewhere = provider.ask("token first someone-else")  # signed by the provider, for another audience
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base_url + "/v1", api_key=elsewhere, max_retries=0).models.list()

    assert provider.ask("rotate second") == "second"  # the provider adds an ES256 key and signs with it
    rotated = provider.ask("token second triage")
    again = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=rotated, max_retries=0)
    assert again.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "ok"
