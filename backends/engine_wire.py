"""The wire between the gateway and a local engine's worker process (``backends.engine_worker``).

Frames: a 4-byte big-endian length, then one orjson object. The gateway writes to the worker's
stdin and reads the worker's protocol descriptor (its stdout, moved away from fd 1 so that
anything llama.cpp prints natively goes to stderr and never into a frame).

Gateway to worker: ``open`` (an engine: a chat context or a scorer context on the file),
``run`` (one job), ``cancel`` (stop a job: queued, or at its next token), ``close`` (an engine).
Worker to gateway: ``opened`` / ``open_failed``, then per job ``started``, any ``chunk``, and
exactly one ``done`` or ``error``.

Pure: the codecs of the values that cross (questions, scores), no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, fields
from typing import Any

import orjson

from backends.lettered import LetteredScores
from backends.logprob import OptionScores
from policies.cascade import Question

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024  # a frame longer than this is a broken wire, not a message


def frame(message: dict[str, Any]) -> bytes:
    data = orjson.dumps(message, option=orjson.OPT_SERIALIZE_NUMPY)
    return HEADER.pack(len(data)) + data


def frame_length(header: bytes) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes: the wire is broken")
    return n


def question_to_wire(q: Question) -> dict[str, Any]:
    return asdict(q)


def question_from_wire(d: dict[str, Any]) -> Question:
    scale = d.get("scale")
    return Question(
        type=d["type"],
        question=d["question"],
        options=tuple(d["options"]),
        context=d.get("context"),
        task=d.get("task"),
        scale=(int(scale[0]), int(scale[1])) if scale else None,
    )


def scores_to_wire(s: OptionScores) -> dict[str, Any]:
    out = asdict(s)
    out["lettered"] = isinstance(s, LetteredScores)
    return out


def scores_from_wire(d: dict[str, Any]) -> OptionScores:
    d = dict(d)
    lettered = d.pop("lettered", False)
    cls = LetteredScores if lettered else OptionScores
    names = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in d.items() if k in names}
    kwargs["logprobs"] = tuple(kwargs["logprobs"])
    kwargs["tokens"] = tuple(kwargs["tokens"])
    return cls(**kwargs)
