"""``python -m tests.console_shots [DIR]`` (``make console-shots``): the console's screenshots in
docs/console.md, made as its tests drive it. A gateway on scripted backends (a two-tier cascade, an
open model) under a real uvicorn is given some traffic by the official client (typed decisions,
some escalated, chat, an error, a batch), then Debian's headless Chromium logs in and photographs
each page at 1280x800, and the traffic page at a phone's width (390x844)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gateway.http import console_auth
from tests.browser import chromium
from tests.conftest import GatewayRunner
from tests.http.test_console import ADMIN, APP, log_in, policy

PAGES = [
    ("traffic", "/console"),
    ("decisions", "/console/decisions"),
    ("trace", "/console/requests/shot-escalated"),
    ("keys", "/console/keys"),
    ("batches", "/console/batches"),
    ("reports", "/console/reports"),
]


def traffic(base: str, tmp: Path) -> None:
    auth = {"authorization": f"Bearer {APP}"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as http:
        for i in range(24):
            options = ["first", "second", "third", "fourth"][: 4 if i % 3 == 1 else 2]  # 4: below the threshold
            body = {"question": f"Question {i}: which one?", "type": "choice", "options": options}
            rid = "shot-escalated" if i == 1 else f"shot-{i}"
            http.post("/v1/decide", json=body, headers={"x-request-id": rid})
        for i in range(6):
            http.post(
                "/v1/chat/completions", json={"model": "auto", "messages": [{"role": "user", "content": f"hi {i}"}]}
            )
        http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        system = {"role": "system", "content": "You are terse."}
        lines = [
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "cheap", "messages": [system, {"role": "user", "content": f"q{i}"}]},
            }
            for i in range(8)
        ]
        path = tmp / "batch.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        with path.open("rb") as f:
            file_id = http.post("/v1/files", files={"file": f}, data={"purpose": "batch"}).json()["id"]
        made = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch = http.post("/v1/batches", json=made).json()
        deadline = time.monotonic() + 30
        while http.get(f"/v1/batches/{batch['id']}").json()["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.1)
    admin = {"authorization": f"Bearer {ADMIN}"}
    httpx.post(base + "/admin/keys", json={"name": "team-search", "models": ["auto"]}, headers=admin, timeout=30)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(console_auth.SECRET_ENV, "console-shots")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        reports = tmp / "reports"
        reports.mkdir()
        for name in ("hidden_probe.json", "bench-quality.json"):
            src = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / name
            if src.exists():
                (reports / name).write_bytes(src.read_bytes())
        runner = GatewayRunner(tmp)
        try:
            gw = runner.start(policy(threshold=0.65))
            traffic(gw.base_url, tmp)
            with chromium() as browser:
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                log_in(page, gw)
                page.get_by_role("heading", name="Traffic").wait_for()
                for name, path in PAGES:
                    page.goto(gw.base_url + path)
                    page.wait_for_timeout(1200 if name == "traffic" else 100)  # one poll of the live numbers
                    page.screenshot(path=str(out / f"{name}.png"))
                    print(out / f"{name}.png")
                phone = browser.new_page(viewport={"width": 390, "height": 844})
                log_in(phone, gw)
                phone.wait_for_timeout(1200)
                phone.screenshot(path=str(out / "traffic-phone.png"))
                print(out / "traffic-phone.png")
        finally:
            runner.stop_all()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/console"))
