"""One adapter from "reasoning on/off" to each engine family's own switch. Pure.

| switch | engines | on | off |
|---|---|---|---|
| ``chat_template_kwargs`` | vLLM, SGLang (Qwen3, DeepSeek-R1 distills, GLM) | ``enable_thinking: true`` | ``false`` |
| ``reasoning_effort`` | OpenAI reasoning models: ``gpt-5`` / ``o-series`` | ``"medium"`` | ``"minimal"`` / ``"low"`` |
| ``none`` | models without a switch | unchanged | unchanged |

``auto`` picks by the model's ``family``. A client that set the switch itself is never overridden.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from policies.schema import ModelSpec

THINKING_FAMILIES = frozenset({"qwen3", "qwen3-moe", "deepseek-r1", "glm-4.5", "hunyuan", "granite-3.3"})
# the lowest effort each family takes: o1/o3/o4-mini know no "minimal"; plain chat models
# (gpt-4o and the like, family "openai") take no reasoning_effort at all
LOWEST_EFFORT = {"gpt-5": "minimal", "o-series": "low"}


def switch_of(spec: ModelSpec) -> str:
    if spec.reasoning_switch != "auto":
        return spec.reasoning_switch
    if spec.family in THINKING_FAMILIES:
        return "chat_template_kwargs"
    if spec.family in LOWEST_EFFORT:
        return "reasoning_effort"
    return "none"


def apply(body: dict[str, Any], spec: ModelSpec, on: bool) -> tuple[dict[str, Any], str]:
    """The request body with reasoning switched for ``spec``, and the switch used."""
    switch = switch_of(spec)
    if switch == "chat_template_kwargs":
        given = body.get("chat_template_kwargs") or {}
        if not isinstance(given, dict):
            raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
        kwargs = dict(given)
        if "enable_thinking" in kwargs:
            return body, "client"
        kwargs["enable_thinking"] = on
        return {**body, "chat_template_kwargs": kwargs}, switch
    if switch == "reasoning_effort":
        if "reasoning_effort" in body:
            return body, "client"
        return {**body, "reasoning_effort": "medium" if on else LOWEST_EFFORT.get(spec.family, "low")}, switch
    return body, "none"
