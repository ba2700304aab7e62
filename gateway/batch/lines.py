"""A batch's input file checked line by line, and its requests planned into prefix groups: what
a runner does once per batch, before any request runs. Pure: no I/O, no store."""

from __future__ import annotations

from typing import Any

import orjson

from backends.prefix import Item, plan
from gateway.service.bodies import MAX_DEPTH, check_depth
from gateway.state.batches.model import Row, new_id
from policies.errors import InvalidRequest


def check_lines(
    raw: bytes,
    endpoint: str,
    models: set[str],
    max_requests: int,
) -> list[Row]:
    """Every line of an input file: (line, custom_id, body) to run, or an error result for the
    error file naming the line. A malformed line never stops the others."""
    rows: list[Row] = []
    seen: dict[str, int] = {}  # custom_id -> the line that has it
    lines = [(n, line) for n, line in enumerate(raw.split(b"\n"), 1) if line.strip()]
    for n, line in lines:
        cid = None
        try:
            doc = orjson.loads(line)
            if not isinstance(doc, dict):
                raise InvalidRequest("the line is not a JSON object")
            cid = doc.get("custom_id") if isinstance(doc.get("custom_id"), str) else None
            if cid is not None and "\x00" in cid:  # no store of text keeps it: the line's error, without the id
                cid = None
                raise InvalidRequest("custom_id may not hold a NUL character")
            if cid in seen:  # its error line carries no custom_id: the id's one result is the first line's
                first, cid = seen[cid], None
                raise InvalidRequest(f"custom_id {doc['custom_id']!r} is used twice (first on line {first})")
            if cid:
                seen[cid] = n  # taken even when this line fails: its error line is then the id's one entry
            check_depth(line, doc, MAX_DEPTH + 1)  # the body nests as deep as the API lets it
            body = _check_line(doc, endpoint, models)
            if len(rows) >= max_requests:
                raise InvalidRequest(f"over the limit of {max_requests} requests per batch")
            rows.append(Row(n, cid, body, None))
        except (orjson.JSONDecodeError, InvalidRequest) as exc:
            message = exc.message if isinstance(exc, InvalidRequest) else f"not JSON: {exc}"
            rows.append(
                Row(
                    n,
                    cid,
                    None,
                    {
                        "id": new_id("batch_req_"),
                        "custom_id": cid,
                        "response": None,
                        "error": {"code": "invalid_request", "message": f"line {n}: {message}"},
                    },
                )
            )
    return rows


def _check_line(doc: dict[str, Any], endpoint: str, models: set[str]) -> dict[str, Any]:
    cid = doc.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise InvalidRequest("custom_id must be a non-empty string")
    if doc.get("method", "POST") != "POST":
        raise InvalidRequest("method must be POST")
    if doc.get("url") != endpoint:
        raise InvalidRequest(f"url {doc.get('url')!r} is not the batch's endpoint {endpoint}")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    model = body.get("model")
    if endpoint != "/v1/decide" and not isinstance(model, str):
        raise InvalidRequest("body.model must be a string")
    if endpoint != "/v1/decide" and model not in models:
        raise InvalidRequest(f"the model {model!r} does not exist")
    if body.get("stream"):
        raise InvalidRequest("a batch request cannot stream")
    return body


def plan_rows(
    batch_id: str,
    rows: list[Row],
    tokens: list[tuple[int, ...]],
    *,
    min_shared: int,
    order: str,
    claim_max: int,
) -> tuple[list[Row], int]:
    """Every row, each request with the group a runner claims it in, its place in the dispatch
    order and its prefix group's affinity key; and the number of groups. ``tokens``: the prompts of
    the rows to run, in order.

    A claim is one prefix group; one larger than ``claim_max`` requests is cut into parts (several
    gateways can then work it at once), all with the group's affinity key, so they go to one
    replica. Requests that share no prefix with any other (groups of one: no cache to keep warm)
    are packed together, ``claim_max`` at most, so unrelated prompts are not a claim each."""
    runnable = [r for r in rows if r.error is None]
    assert len(tokens) == len(runnable)
    planned = plan(
        [Item(i, t, _decode(r.body or {})) for i, (t, r) in enumerate(zip(tokens, runnable, strict=True))],
        min_shared=min_shared,
        order=order,
    )
    parts: list[list[tuple[int, str]]] = []  # per claim: (index in runnable, affinity key)
    packing = False  # the last part holds groups of one
    for g, group in enumerate(planned):
        key = f"{batch_id}/{g}"
        if len(group.keys) == 1:
            if not packing or len(parts[-1]) >= claim_max:
                parts.append([])
                packing = True
            parts[-1].append((group.keys[0], key))
            continue
        packing = False
        parts.extend([(k, key) for k in group.keys[i : i + claim_max]] for i in range(0, len(group.keys), claim_max))
    out = [r for r in rows if r.error is not None]
    seq = 0
    for grp, part in enumerate(parts):
        for k, key in part:
            out.append(runnable[k]._replace(grp=grp, seq=seq, affinity=key))
            seq += 1
    return out, len(parts)


def _decode(body: dict[str, Any]) -> int:
    """Expected decode tokens, for the order: the request's own limit, else a guess."""
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 0:
            return body[key]
    return 16
