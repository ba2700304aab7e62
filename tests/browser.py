"""Headless Chromium for the console's tests and screenshots: Debian's ``chromium`` (``make services``
installs it), driven through playwright's driver; playwright's own browsers are never downloaded."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser

# as root and on a closed network: no sandbox, no GPU, none of Chromium's own calls home
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str | None:
    return os.environ.get("TRIAGE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def chromium() -> Iterator[Browser]:
    """One headless Chromium; RuntimeError where there is none (``make services`` installs it)."""
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        raise RuntimeError("no chromium on PATH: `make services` installs Debian's (or set TRIAGE_CHROMIUM)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()
