"""Real servers the tests start themselves, from the packages `make test` installs (Debian's
redis-server and postgresql): each on a free loopback port, in a fresh folder, stopped after.
Fixtures, registered by tests/conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests import lanes


@contextlib.contextmanager
def asgi_server(app: Any) -> Iterator[str]:
    """``app`` (an ASGI app: a fake engine) under a real uvicorn in a thread; its base URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
@lanes.fleet
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis server (Debian's redis-server, which make test installs) on a free loopback port."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not installed: make test installs it (apt-get install redis-server)")
        pytest.skip("redis-server is not installed: apt-get install redis-server (make test does)")
    port = free_port()
    work = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def pg_binaries() -> tuple[str, str] | None:
    """initdb and postgres, from one installation: on PATH, else Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("postgres")
    dirs = [str(Path(found).resolve().parent)] if found else []
    dirs += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name), reverse=True)
    for d in dirs:
        initdb, postgres = Path(d) / "initdb", Path(d) / "postgres"
        if initdb.exists() and postgres.exists():
            return str(initdb), str(postgres)
    return None


def server_user() -> pwd.struct_passwd | None:
    """Who runs the server: initdb and postgres refuse root, so as root a user that exists
    (Debian's package makes ``postgres``; ``nobody`` otherwise); None: ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    pytest.fail("running as root, and neither a postgres nor a nobody user exists to run PostgreSQL")


FAST = ("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")  # a throwaway cluster


@dataclass
class PgServer:
    port: int
    admin_dsn: str  # the superuser on the maintenance database

    def dsn(self, database: str, password: str = "") -> str:
        secret = f":{password}" if password else ""
        return f"postgresql://postgres{secret}@127.0.0.1:{self.port}/{database}"

    def sql(self, query: str) -> Any:
        async def run() -> Any:
            conn = await asyncpg.connect(self.admin_dsn)
            try:
                return await conn.fetch(query)
            finally:
                await conn.close()

        return asyncio.run(run())


@pytest.fixture(scope="session")
@lanes.fleet
def pg() -> Iterator[PgServer]:
    """A real PostgreSQL server (Debian's postgresql, which make test installs) on a free
    loopback port, its cluster in a fresh folder; as root, run by an unprivileged user."""
    binaries = pg_binaries()
    if binaries is None:
        if os.environ.get("CI") == "true":
            pytest.fail("PostgreSQL is not installed: make test installs it (apt-get install postgresql)")
        pytest.skip("PostgreSQL (initdb, postgres) is not installed: apt-get install postgresql (make test does)")
    initdb, postgres = binaries
    user = server_user()
    work = Path(tempfile.mkdtemp(prefix="triage-pg-"))  # not under pytest's tmp: root's 0700 folder
    as_user: dict[str, Any] = {}
    if user is not None:
        os.chown(work, user.pw_uid, user.pw_gid)
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(work), "LC_ALL": "C"}
    data, port = work / "data", free_port()
    proc = None
    try:
        subprocess.run(
            [initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync"],
            check=True,
            capture_output=True,
            cwd=work,
            env=env,
            **as_user,
        )
        with (work / "server.log").open("wb") as log:
            proc = subprocess.Popen(
                [postgres, "-D", str(data), "-p", str(port), "-k", str(work), "-h", "127.0.0.1", *FAST],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=work,
                env=env,
                **as_user,
            )
        server = PgServer(port, f"postgresql://postgres@127.0.0.1:{port}/postgres")
        deadline = time.monotonic() + 30
        while True:
            try:
                server.sql("SELECT 1")
                break
            except (OSError, asyncpg.PostgresError) as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (work / "server.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"PostgreSQL did not start ({exc}): {tail}") from None
                time.sleep(0.1)
        yield server
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


_names = iter(range(10**6))


@pytest.fixture
def database(pg: PgServer) -> str:
    """A fresh database of its own; its DSN."""
    name = f"t{os.getpid()}_{next(_names)}"
    pg.sql(f"CREATE DATABASE {name}")
    return pg.dsn(name)
