"""``env:NAME`` references, read in one place (``policies/secrets.py``) by everything that takes
one: a backend's api_key, a key's sha256, the admin key, ``state.url``, ``state.database``."""

from __future__ import annotations

import asyncio

import pytest

from gateway.state.stores import StoreDown, open_store
from policies.schema import StateSpec
from policies.secrets import MissingSecret, resolve_secret, secret_name


def test_a_reference_is_read_from_the_environment_and_a_value_is_itself() -> None:
    env = {"TRIAGE_DSN": "postgresql://db/x"}
    assert resolve_secret("env:TRIAGE_DSN", env) == "postgresql://db/x"
    assert resolve_secret("postgresql://db/y", env) == "postgresql://db/y"
    assert resolve_secret(None, env) is None
    assert (secret_name("env:TRIAGE_DSN"), secret_name("postgresql://db/y")) == ("TRIAGE_DSN", None)
    with pytest.raises(MissingSecret, match="environment variable TRIAGE_UNSET is not set"):
        resolve_secret("env:TRIAGE_UNSET", env)


def test_an_unset_state_reference_stops_the_store_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIAGE_TEST_NO_SUCH_URL", raising=False)
    with pytest.raises(StoreDown, match=r"state\.url: environment variable TRIAGE_TEST_NO_SUCH_URL is not set"):
        asyncio.run(open_store(StateSpec(store="redis", url="env:TRIAGE_TEST_NO_SUCH_URL")))
