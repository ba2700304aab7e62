"""Typed decisions through the OpenAI surface: a chat request whose ``response_format`` is a
JSON schema with one property that is an ``enum`` (choice), a ``boolean`` (yes_no) or a bounded
``integer``/``number`` (score on a scale) is answered by the cascade.

The reply is an ordinary ``chat.completion``: the content is JSON valid against the schema
(``{"<property>": <value>}``), ``choices[0].logprobs.content`` holds one position whose
``top_logprobs`` are the options with their log-probabilities, and the decision (probabilities,
confidence, tier, trace) is in the extension field ``triage``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import orjson

from backends.base import Body
from gateway.service.messages import text as message_text
from policies.cascade import YES_NO, Decision, Question
from policies.errors import InvalidRequest
from policies.tiers import Cascade


@dataclass(frozen=True)
class TypedAsk:
    question: Question
    prop: str
    values: tuple[Any, ...]  # the JSON value of each option, in order


def _bounds(schema: dict[str, Any]) -> tuple[int, int] | None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (lo, hi)):
        return None
    lo_i, hi_i = math.ceil(lo), math.floor(hi)  # type: ignore[arg-type]
    return (lo_i, hi_i) if hi_i > lo_i else None


def typed_ask(body: Body, spec: Cascade) -> TypedAsk | None:
    """The typed question in a chat body, or None when its response_format is not one."""
    rf = body.get("response_format")
    if not isinstance(rf, dict) or rf.get("type") != "json_schema":
        return None
    json_schema = rf.get("json_schema")
    if not isinstance(json_schema, dict):
        raise InvalidRequest("response_format.json_schema must be an object", param="response_format.json_schema")
    schema = json_schema.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise InvalidRequest(
            "response_format.json_schema.schema must be an object", param="response_format.json_schema.schema"
        )
    props = schema.get("properties") if schema is not None else None
    if not isinstance(props, dict) or len(props) != 1:
        return None
    [(prop, sub)] = props.items()
    if not isinstance(sub, dict):
        return None
    turns = [
        (m.get("role"), message_text(m.get("content")))
        for m in body.get("messages") or ()
        if isinstance(m, dict) and m.get("role") in ("user", "assistant")
    ]
    last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last_user is None:
        raise InvalidRequest("a typed request needs a user message", param="messages")
    question = turns[last_user][1]  # the last user turn; the turns before it are its context
    context = "\n\n".join(text for _, text in turns[:last_user] if text) or None
    if isinstance(sub.get("enum"), list) and sub["enum"]:
        values = tuple(sub["enum"])
        if not 2 <= len(values) <= spec.max_options:
            raise InvalidRequest(f"the enum needs 2 to {spec.max_options} values", param="response_format")
        return TypedAsk(Question("choice", question, tuple(str(v) for v in values), context), prop, values)
    if sub.get("type") == "boolean":
        return TypedAsk(Question("yes_no", question, YES_NO, context), prop, (True, False))
    if sub.get("type") in ("integer", "number") and (scale := _bounds(sub)) is not None:
        if scale[1] - scale[0] + 1 > spec.max_scale:
            raise InvalidRequest(f"a scale may have at most {spec.max_scale} values", param="response_format")
        values = tuple(range(scale[0], scale[1] + 1))
        return TypedAsk(Question("score", question, tuple(str(v) for v in values), context, scale=scale), prop, values)
    return None


def _token(option: str, p: float) -> dict[str, Any]:
    return {"token": option, "logprob": math.log(max(p, 1e-12)), "bytes": list(option.encode())}


def completion(ask: TypedAsk, d: Decision, model: str, request_id: str, extension: dict[str, Any]) -> Body:
    index = ask.question.options.index(d.answer)
    content = orjson.dumps({ask.prop: ask.values[index]}).decode()
    top = sorted(d.probabilities.items(), key=lambda kv: -kv[1])
    position = {**_token(d.answer, d.probabilities[d.answer]), "top_logprobs": [_token(o, p) for o, p in top]}
    # an answer that came without probabilities (the tier's assumed confidence) has no logprobs to give:
    # invented numbers are never returned as measured ones (the decision in `triage` says so)
    logprobs = None if d.assumed else {"content": [position]}
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, **_usage(d)},
        "triage": extension,
    }


def _usage(d: Decision) -> dict[str, int]:
    u = d.usage or {}
    out = {k: int(u[k]) for k in ("prompt_tokens", "completion_tokens") if isinstance(u.get(k), int)}
    if out:
        out["total_tokens"] = sum(out.values())
    return out


def chunks(reply: Body) -> list[Body]:
    """The same reply as stream chunks: the role, the content, then the finish."""
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"], "model": reply["model"]}
    choice = reply["choices"][0]
    return [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": choice["message"]["content"]},
                    "logprobs": choice["logprobs"],
                    "finish_reason": None,
                }
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "triage": reply["triage"]},
    ]
