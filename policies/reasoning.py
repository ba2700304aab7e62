"""One adapter from "reasoning on/off" to each engine family's own switch. Pure.

| switch | engines | on | off |
|---|---|---|---|
| ``chat_template_kwargs`` | vLLM, SGLang (Qwen3, DeepSeek-R1 distills, GLM) | ``enable_thinking: true`` | ``false`` |
| ``reasoning_effort`` | OpenAI-style APIs (o-series, gpt-5) | ``"medium"`` | ``"minimal"`` |
| ``none`` | models without a switch | unchanged | unchanged |

``auto`` picks by the model's ``family``. A client that set the switch itself is never overridden.
"""

from __future__ import annotations

from typing import Any

from policies.schema import ModelSpec

THINKING_FAMILIES = frozenset({"qwen3", "qwen3-moe", "deepseek-r1", "glm-4.5", "hunyuan", "granite-3.3"})
EFFORT_FAMILIES = frozenset({"openai", "o-series", "gpt-5"})


def switch_of(spec: ModelSpec) -> str:
    if spec.reasoning_switch != "auto":
        return spec.reasoning_switch
    if spec.family in THINKING_FAMILIES:
        return "chat_template_kwargs"
    if spec.family in EFFORT_FAMILIES:
        return "reasoning_effort"
    return "none"


def apply(body: dict[str, Any], spec: ModelSpec, on: bool) -> tuple[dict[str, Any], str]:
    """The request body with reasoning switched for ``spec``, and the switch used."""
    switch = switch_of(spec)
    if switch == "chat_template_kwargs":
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if "enable_thinking" in kwargs:
            return body, "client"
        kwargs["enable_thinking"] = on
        return {**body, "chat_template_kwargs": kwargs}, switch
    if switch == "reasoning_effort":
        if "reasoning_effort" in body:
            return body, "client"
        return {**body, "reasoning_effort": "medium" if on else "minimal"}, switch
    return body, "none"
