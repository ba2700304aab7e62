"""Load a policy file: YAML (with positions) -> pydantic -> reference checks -> files.

All problems are collected and reported at once, each as ``file:line:col: path: message``.
Files the policy names (``models.NAME.tokenizer``, relative to the policy file; a backend's
``gguf.path``, as the backend opens it) must exist when a policy is loaded from a file.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError

from policies import catalogue
from policies.errors import PolicyInvalid
from policies.references import reference_problems
from policies.schema import LOCAL_GGUF, Loc, Policy, RoutedModel
from policies.secrets import secret_name


@dataclass(frozen=True)
class Problem:
    file: str
    line: int  # 1-based
    col: int  # 1-based
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.file}:{self.line}:{self.col}: {where}{self.message}"


def _to_plain(node: Any) -> Any:
    if isinstance(node, CommentedMap):
        return {str(k): _to_plain(v) for k, v in node.items()}
    if isinstance(node, CommentedSeq):
        return [_to_plain(v) for v in node]
    return node


def _position(root: Any, loc: Loc) -> tuple[int, int]:
    """Line and column (0-based) of the deepest node of ``loc`` present in the YAML tree.

    Steps that are not in the data (the tag of a discriminated union, a missing field) are
    skipped, so the position is that of the closest enclosing node that exists.
    """
    node, line, col = root, 0, 0
    if isinstance(root, CommentedMap | CommentedSeq):
        line, col = root.lc.line, root.lc.col
    for step in loc:
        if isinstance(node, CommentedMap) and step in node:
            line, col = node.lc.key(step)
            node = node[step]
        elif isinstance(node, CommentedSeq) and isinstance(step, int) and 0 <= step < len(node):
            line, col = node.lc.item(step)
            node = node[step]
    return line, col


def _dotted(loc: Loc) -> str:
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def file_problems(policy: Policy, base_dir: Path) -> list[tuple[Loc, str]]:
    """Every file the policy names that is not there (``base_dir``: the policy file's folder)."""
    problems: list[tuple[Loc, str]] = []
    for name, spec in policy.models.items():
        if (found := spec.tokenizer_file(base_dir)) is not None and not found.is_file():
            problems.append((("models", name, "tokenizer"), f"tokenizer file not found: {found}"))
    for name, backend in policy.backends.items():
        path = backend.gguf.path if isinstance(backend, LOCAL_GGUF) else None
        if path is not None and not Path(path).expanduser().is_file():
            problems.append((("backends", name, "gguf", "path"), f"GGUF file not found: {Path(path).expanduser()}"))
    problems.extend(_labels_problems(policy, base_dir))
    return problems


LABEL_COLUMNS = {"reasoning": ("direct", "cot")}  # reasoning/ files: the same model without and with CoT


def _labels_problems(policy: Policy, base_dir: Path) -> list[tuple[Loc, str]]:
    """A routed model's labels file must hold a column per candidate. Checked where the policy's
    data_dir is there (a gateway serves without the labels; only training reads them)."""
    if policy.classifier is None:
        return []
    root = (base_dir / policy.classifier.data_dir).resolve()
    if not root.is_dir():
        return []
    problems: list[tuple[Loc, str]] = []
    for name, vm in policy.virtual_models.items():
        if not isinstance(vm, RoutedModel):
            continue
        folder = vm.labels.rpartition("/")[0]
        found = [root / f"{vm.labels}{suffix}" for suffix in (".jsonl", ".jsonl.gz")]
        path = next((f for f in found if f.is_file()), None)
        if path is None:
            problems.append((("virtual_models", name, "labels"), f"labels file not found: {found[0]}[.gz]"))
            continue
        has = LABEL_COLUMNS.get(folder) or _first_row_columns(path)
        for i, c in enumerate(vm.candidates):
            if c.column not in has:
                where: Loc = ("virtual_models", name, "candidates", i)
                problems.append(
                    (
                        where,
                        f"labels {vm.labels} have no column '{c.column}' (has: {', '.join(has)}); "
                        "name it with labels_as",
                    )
                )
    return problems


def _first_row_columns(path: Path) -> tuple[str, ...]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        first = json.loads(f.readline() or "{}")
    return tuple(sorted(first.get("correct") or first.get("score") or {}))


def parse(text: str, file: str = "<policy>", base_dir: Path | None = None, *, catalogued: bool = True) -> Policy:
    """Validate policy text; raise :class:`PolicyInvalid` listing every problem. With ``base_dir``
    (the policy file's folder) the files it names are checked too. ``catalogued``: a provider
    model's missing prices and context window taken from litellm's catalogue
    (:mod:`policies.catalogue`); False: the policy as written."""
    yaml = YAML(typ="rt")
    try:
        root = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line, mark.column) if mark else (0, 0)
        problem = Problem(file, line + 1, col + 1, "", f"YAML syntax: {exc.problem or exc}")
        raise PolicyInvalid([str(problem)]) from None
    if not isinstance(root, CommentedMap):
        raise PolicyInvalid([str(Problem(file, 1, 1, "", "a policy is a YAML mapping"))])
    problems: list[Problem] = []
    try:
        policy = Policy.model_validate(_to_plain(root))
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            loc = tuple(err["loc"])
            if err["type"] == "union_tag_invalid":
                loc = (*loc, "type")  # point at the offending tag itself
            line, col = _position(root, loc)
            problems.append(Problem(file, line + 1, col + 1, _dotted(loc), err["msg"]))
        raise PolicyInvalid([str(p) for p in problems]) from None
    found = reference_problems(policy) + (file_problems(policy, base_dir) if base_dir is not None else [])
    for loc, message in found:
        line, col = _position(root, loc)
        problems.append(Problem(file, line + 1, col + 1, _dotted(loc), message))
    if problems:
        raise PolicyInvalid([str(p) for p in problems])
    return catalogue.fill(policy) if catalogued else policy


SECRET_FIELDS = frozenset({"api_key", "sha256", "admin_key", "url", "database"})  # those that take env:NAME


def _secret_refs(node: Any, loc: Loc = ()) -> list[tuple[Loc, str]]:
    """Every ``env:NAME`` reference in the policy's secret fields (``api_key``, a key's ``sha256``,
    ``access.admin_key``, ``state.url`` and ``state.database``)."""
    if isinstance(node, dict):
        found = []
        for k, v in node.items():
            if k in SECRET_FIELDS and isinstance(v, str) and (name := secret_name(v)) is not None:
                found.append(((*loc, k), name))
            else:
                found.extend(_secret_refs(v, (*loc, k)))
        return found
    if isinstance(node, list):
        return [ref for i, v in enumerate(node) for ref in _secret_refs(v, (*loc, i))]
    return []


def unset_secrets(path: str | Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """``file:line:col: path: ...`` for each secret the policy (already valid) references by an
    environment variable that is not set: the gateway cannot start its backends or keys without it."""
    env = os.environ if environ is None else environ
    path = Path(path)
    root = YAML(typ="rt").load(path.read_text(encoding="utf-8"))
    problems = []
    for loc, name in _secret_refs(_to_plain(root)):
        if name not in env:
            line, col = _position(root, loc)
            problems.append(
                str(Problem(str(path), line + 1, col + 1, _dotted(loc), f"environment variable {name} is not set"))
            )
    return problems


def located(path: str | Path | None, problems: Sequence[tuple[Loc, str]]) -> list[str]:
    """``file:line:col: path: message`` for problems found after loading (against the engines, at
    start-up); without the file, ``path: message``."""
    if path is None:
        return [f"{_dotted(loc)}: {message}" for loc, message in problems]
    root = YAML(typ="rt").load(Path(path).read_text(encoding="utf-8"))
    out = []
    for loc, message in problems:
        line, col = _position(root, loc)
        out.append(str(Problem(str(path), line + 1, col + 1, _dotted(loc), message)))
    return out


def load(path: str | Path, *, catalogued: bool = True) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyInvalid([f"{path}:1:1: cannot read: {exc.strerror or exc}"]) from None
    return parse(text, str(path), path.parent, catalogued=catalogued)
