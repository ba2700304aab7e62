"""Where triage's time goes: sample the gateway process under load.

With py-spy (``pip install py-spy``) the running process is sampled from outside, without
slowing it much; otherwise the gateway is run under cProfile (much slower, but it shows the
same places). Both give the top functions by own and by cumulative time, and own time by package.
"""

from __future__ import annotations

import asyncio
import pstats
import re
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_SKIP = ("<module>",)  # import-time frames say nothing about request handling
# frames under which everything runs: left out of the cumulative table (own time still counts)
_ROOTS = {
    "asyncio_run",
    "Server.run",
    "Server.serve",
    "Server._serve",
    "Server.main_loop",
    "Runner.run",
    "run",
    "main",
    "serve",
    "run_until_complete",
    "run_forever",
    "_run_once",
    "Handle._run",
    "_run_code",
    "_run_module_as_main",
}
_ROOT_PACKAGES = ("typer", "click", "<frozen runpy>")
# leaves where a thread waits for work: a thread pool's idle workers, sampled in blocking mode
_IDLE_LEAVES = {("_worker", "thread.py"), ("wait", "threading.py"), ("get", "queue.py")}
# a frame's own time that is really native code below it (py-spy samples Python frames only)
NATIVE = {
    "Runner.run": "the event loop itself: uvloop's C code (epoll, callbacks, socket I/O)",
    "StreamWriter._writelines": "aiohttp sending the upstream request (mostly the send syscall)",
}


def pyspy() -> Path | None:
    here = Path(sys.executable).with_name("py-spy")
    found = here if here.exists() else shutil.which("py-spy")
    return Path(found) if found else None


@dataclass
class Profile:
    tool: str
    samples: int
    own: list[tuple[str, float]] = field(default_factory=list)  # (function, share of samples)
    cumulative: list[tuple[str, float]] = field(default_factory=list)
    packages: list[tuple[str, float]] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        def rows(xs: list[tuple[str, float]]) -> list[dict[str, Any]]:
            return [{"name": n, "share": round(s, 4)} for n, s in xs]

        return {
            "tool": self.tool,
            "samples": self.samples,
            "note": self.note,
            "own": rows(self.own),
            "cumulative": rows(self.cumulative),
            "packages": rows(self.packages),
        }


def package_of(path: str) -> str:
    """A short owner for a source path: the site-packages top level, a repo dir, or the stdlib module."""
    if path == "~":
        return "builtins (C)"
    p = path.replace("\\", "/")
    if "site-packages/" in p:
        return p.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    m = re.search(r"/lib/python3\.\d+/([^/]+)", p)
    if m:
        return "stdlib:" + m.group(1).removesuffix(".py")
    for top in ("gateway", "backends", "policies", "classifiers", "eval"):
        if f"/{top}/" in p or p.startswith(f"{top}/"):
            return f"triage:{top}"
    return p.rsplit("/", 1)[-1] or "?"


def _label(func: str, path: str) -> str:
    return f"{func} ({package_of(path)}:{path.rsplit('/', 1)[-1]})"


async def record_pyspy(exe: Path, pid: int, duration_s: float, out: Path, rate: int = 100) -> Profile:
    """Sample ``pid`` for ``duration_s`` while the caller runs load; parse py-spy's raw output.
    Blocking mode (the process pauses for each sample, which slows it: the caller reports the
    req/s under the profiler): non-blocking reads of a busy process give torn stacks. Native
    frames too, so that the garbage collector's time shows (py-spy has no other view of it)."""
    argv = [
        str(exe),
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(duration_s))),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--full-filenames",
        "--native",
        "--output",
        str(out),
    ]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        text, _ = await asyncio.wait_for(proc.communicate(), timeout=duration_s + 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({proc.returncode}): {text.decode(errors='replace')[-500:]}")
    return parse_collapsed(out.read_text(), tool="py-spy")


GC = "cyclic garbage collector (gc_collect_main, native)"


def _is_python(m: re.Match[str]) -> bool:
    return m["file"].endswith(".py") or m["file"].startswith("<frozen")


def parse_collapsed(text: str, tool: str, top: int = 40) -> Profile:
    """Collapsed stacks (``frame;frame;... count``) to own / cumulative / package shares.
    With ``--native`` stacks, own time goes to the deepest Python frame, except the time of the
    cyclic GC, which gets its own row (it runs inside whichever frame allocated)."""
    own: Counter[str] = Counter()
    cum: Counter[str] = Counter()
    pkgs: Counter[str] = Counter()
    total = idle = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [m for f in stack.split(";") if (m := _FRAME.match(f)) and m["func"] not in _SKIP]
        gc = any(m["func"].startswith(("gc_collect", "collect_generation")) for m in frames if not _is_python(m))
        frames = [m for m in frames if _is_python(m)]
        if not frames or (frames[-1]["func"], frames[-1]["file"].rsplit("/", 1)[-1]) in _IDLE_LEAVES:
            idle += n
            continue
        total += n
        labels = [_label(m["func"], m["file"]) for m in frames]
        own[GC if gc else labels[-1]] += n
        pkgs["gc" if gc else package_of(frames[-1]["file"])] += n
        for m, lab in {(m["func"], lab) for m, lab in zip(frames, labels, strict=True)}:
            if m not in _ROOTS and not lab.split("(", 1)[-1].startswith(_ROOT_PACKAGES):
                cum[lab] += n
    return Profile(
        tool,
        total,
        _shares(own, total, top),
        _shares(cum, total, 400),
        _shares(pkgs, total, top),
        note=f"{idle} samples without a running Python frame (idle threads) left out" if idle else "",
    )


def _shares(c: Counter[str], total: float, top: int) -> list[tuple[str, float]]:
    return [(k, v / total) for k, v in c.most_common(top)] if total else []


def parse_pstats(path: Path, top: int = 40) -> Profile:
    """cProfile stats to the same shape; shares are of the total own time."""
    st = pstats.Stats(str(path))
    raw: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    own: Counter[str] = Counter()
    cum: Counter[str] = Counter()
    pkgs: Counter[str] = Counter()
    for (file, _line, func), (_cc, _nc, tt, ct, _callers) in raw.items():
        if func in _SKIP:
            continue
        lab = _label(func, file)
        own[lab] += tt
        if func not in _ROOTS and file != "~":
            cum[lab] = max(cum[lab], ct)
        pkgs[package_of(file)] += tt
    total = sum(own.values())
    return Profile(
        "cProfile",
        len(raw),
        _shares(own, total, top),
        _shares(cum, total, 400),
        _shares(pkgs, total, top),
        note="cProfile: deterministic, includes start-up; shares are of total own time",
    )
