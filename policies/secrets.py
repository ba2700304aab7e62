"""Secrets are referenced from the policy as ``env:NAME`` (an API key, a key's sha256, the admin
key, the state store's URL, the database's DSN): read here, and only here, when what needs them
is built, never at import. The policy's check (``policies.loader.unset_secrets``) finds the same
references by :func:`secret_name`."""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "env:"


class MissingSecret(LookupError):
    pass


def secret_name(value: str) -> str | None:
    """The environment variable ``value`` names (``env:NAME``), or None when it is a value itself."""
    return value.removeprefix(PREFIX) if value.startswith(PREFIX) else None


def resolve_secret(value: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``value`` itself, or the environment variable it names as ``env:NAME``; None stays None.
    :class:`MissingSecret` when the variable is not set."""
    if value is None or (name := secret_name(value)) is None:
        return value
    env = os.environ if environ is None else environ
    try:
        return env[name]
    except KeyError:
        raise MissingSecret(f"environment variable {name} is not set") from None
