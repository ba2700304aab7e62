"""Secrets are referenced from the policy as ``env:NAME`` and resolved when a backend is built."""

from __future__ import annotations

import os
from collections.abc import Mapping


class MissingSecret(LookupError):
    pass


def lookup(ref: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    if ref is None:
        return None
    env = os.environ if environ is None else environ
    name = ref.removeprefix("env:")
    try:
        return env[name]
    except KeyError:
        raise MissingSecret(f"environment variable {name} is not set") from None
