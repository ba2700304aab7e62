"""``triage doctor``: can this machine serve this policy? What ``triage serve`` checks before it
starts (its own function: unset secrets, limits a worker would keep alone), the CPU, the kernels
each engine was built with, one token through every local model (in its worker process: a fault
is reported with its signal, not suffered), the encoder's ONNX Runtime providers, the state
stores. A table; exit 1 with what to do when something would fail."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gateway.cli.policy_arg import load_or_exit, start_problems
from gateway.cli.serve import default_policy_path
from policies.schema import LOCAL_GGUF, Policy

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    todo: str = ""


def cpu_checks() -> list[Check]:
    from backends import native

    cpu = native.cpu()
    shown = " ".join(f for f in native.FEATURES if f in cpu.flags) or "none of " + ", ".join(native.FEATURES)
    out = [Check("cpu", OK if "avx2" in cpu.flags else WARN, f"{cpu.model}: {cpu.kind} ({shown})")]
    try:
        info = native.llama_system_info()
    except ImportError as exc:
        return [*out, Check("llama.cpp", FAIL, f"llama-cpp-python does not import: {exc}", "make clean && make serve")]
    pairs = [f.partition("=") for f in info.removeprefix("CPU :").split("|")]
    built = " ".join(name.strip() for name, _, value in pairs if value.strip() == "1")
    out.append(Check("llama.cpp build", OK, built))
    amx = 0
    try:
        amx = sum(native.amx_instructions(lib) for lib in native.llama_libraries())
    except native.NoDisassembler as exc:
        out.append(Check("llama.cpp AMX kernels", WARN, f"not checked: {exc}"))
    else:
        if amx == 0:
            out.append(
                Check("llama.cpp AMX kernels", OK, "none compiled in (they fault on AMX CPUs: docs/dependencies.md)")
            )
        else:
            has_amx = {"amx_tile", "amx_int8"} <= cpu.flags
            out.append(
                Check(
                    "llama.cpp AMX kernels",
                    FAIL if has_amx else WARN,
                    f"{amx} AMX instructions in llama.cpp's libraries"
                    + ("; this CPU runs them and they fault on the first token" if has_amx else ""),
                    "rebuild without them: rm .venv/.llama-no-amx && make (docs/dependencies.md)",
                )
            )
    return out


def onnx_check() -> Check:
    try:
        import onnxruntime
    except ImportError as exc:
        return Check("onnxruntime", FAIL, f"does not import: {exc}", "make clean && make serve")
    providers = ", ".join(onnxruntime.get_available_providers())
    return Check("onnxruntime", OK, f"{onnxruntime.__version__}: {providers}")


async def engine_checks(policy: Policy) -> list[Check]:
    """One token through every local model, in its worker process (as the gateway runs it: backends
    on one file share one worker, so each file is loaded once)."""
    from backends import registry

    local = {n: s for n, s in policy.backends.items() if isinstance(s, LOCAL_GGUF)}
    backends = {name: registry.build(name, spec) for name, spec in local.items()}
    out: list[Check] = []
    try:
        for name, backend in backends.items():
            kind = local[name].type
            try:
                await backend.start()  # loads the file (once per file) and runs one token in the worker
            except Exception as exc:  # the doctor's edge: any failure to start is a row of the table
                out.append(Check(f"engine {name}", FAIL, f"{kind}: {type(exc).__name__}: {exc}"))
                continue
            engine = getattr(backend, "engine", None)
            if backend.healthy() and engine is not None:
                out.append(Check(f"engine {name}", OK, f"{kind}: loaded, one token run (worker pid {engine.host.pid})"))
            else:
                problem = engine.problem() if engine is not None else None
                todo = "see docs/operations.md, 'Local engines'"
                out.append(Check(f"engine {name}", FAIL, f"{kind}: {problem or 'not healthy'}", todo))
    finally:
        for backend in backends.values():
            await backend.close()
    return out


async def store_checks(policy: Policy) -> list[Check]:
    from gateway.state.stores import StoreDown, open_store

    state = policy.state
    out: list[Check] = []
    if state.store == "memory":
        out.append(Check("state store", OK, "memory (this process)"))
    else:
        try:
            store, _ = await open_store(state.model_copy(update={"degraded": False}))
            await store.close()
            out.append(Check("state store", OK, "redis: reachable"))
        except StoreDown as exc:
            out.append(Check("state store", FAIL, f"redis: {exc.message}", "start Redis or fix state.url"))
    if state.database is not None:
        out.append(await _database_check(state.database))
    return out


async def _database_check(database: str) -> Check:
    import asyncpg

    from policies.secrets import MissingSecret, resolve_secret

    try:
        url = resolve_secret(database)
        conn = await asyncio.wait_for(asyncpg.connect(url), 5)
        await conn.close()
    except (MissingSecret, OSError, TimeoutError, asyncpg.PostgresError) as exc:
        return Check(
            "database", FAIL, f"postgresql: {type(exc).__name__}: {exc}", "start PostgreSQL or fix state.database"
        )
    return Check("database", OK, "postgresql: reachable")


def start_checks(path: Path, policy: Policy, workers: int) -> list[Check]:
    """What ``triage serve`` checks before it starts, by its own function: a row for each problem."""
    problems = start_problems(path, policy, workers)
    todo = "set it in the environment `triage serve` runs in, or fix the policy"
    if not problems:
        return [Check("policy", OK, f"{path.name}: valid, its secrets set, {workers} worker(s)")]
    return [Check("policy", FAIL, problem, todo) for problem in problems]


def doctor(
    policy: Annotated[
        Path | None, typer.Option(help="Policy YAML (default: the embedded local policy).", envvar="TRIAGE_POLICY")
    ] = None,
    workers: Annotated[
        int, typer.Option(min=1, envvar="TRIAGE_WORKERS", help="The worker processes `triage serve` would run.")
    ] = 1,
) -> None:
    """Check that this machine can serve the policy (everything `triage serve` checks first, then
    the engines and stores); exit 1 with what to do if not."""
    from gateway.obs import logs
    from policies.schema import Logging

    logs.configure(Logging(level="error", format="console"))
    path = policy or default_policy_path()
    loaded = load_or_exit(path)
    starts = start_checks(path, loaded, workers)
    checks = [*starts, *cpu_checks(), onnx_check()]

    async def live() -> list[Check]:
        return [*await engine_checks(loaded), *await store_checks(loaded)]

    if all(c.status != FAIL for c in starts):  # the engines and stores need what is missing
        checks += asyncio.run(live())
    table = Table(title=f"triage doctor: {path.name}")
    for column in ("check", "status", "detail"):
        table.add_column(column)
    colour = {OK: "green", WARN: "yellow", FAIL: "bold red"}
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail)
    console = Console(highlight=False, soft_wrap=False)
    console.print(table)
    failed = [c for c in checks if c.status == FAIL]
    for c in failed:
        console.print(f"[bold red]{c.name}[/]: {c.todo or c.detail}")
    if failed:
        raise typer.Exit(1)
