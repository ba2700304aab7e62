"""One adapter from "reasoning on/off" to each engine family's own switch. Pure.

Per switch: the engines (their ``family``), what "on" and "off" send.

- ``chat_template_kwargs``: vLLM and SGLang, Qwen3, DeepSeek-R1 distills (``deepseek-r1-distill``),
  GLM-4.5, Hunyuan: ``enable_thinking: true`` / ``false``; Granite 3.3 (``granite-3.3``), its
  template's own key: ``thinking: true`` / ``false``.
- ``reasoning_effort``: OpenAI reasoning models, ``gpt-5`` / ``o-series``: ``"medium"`` /
  ``"minimal"`` (``"low"`` for the o-series, which knows no minimal).
- ``thinking``: Anthropic's Claude through litellm (``anthropic``): ``thinking: {type: enabled,
  budget_tokens}`` / ``{type: disabled}``.
- ``gemini_thinking``: Gemini 2.5 Flash and Flash-Lite through litellm (``gemini-2.5``): the same
  ``thinking`` budget (litellm sends it as ``thinkingBudget``) / ``reasoning_effort: "disable"``
  (litellm's ``thinkingBudget: 0``).
- ``always``: DeepSeek-R1 itself (``deepseek-r1``) and Gemini 2.5 Pro (``gemini-2.5-pro``) cannot
  stop thinking: nothing is sent, and the response says ``x-triage-reasoning: unsupported``.
- ``none``: models without a switch: nothing is sent.

``auto`` picks by the model's ``family``; ``thinking_budget`` (a model's setting) is the token
budget the ``thinking`` switches ask for. A client that set the switch itself is never overridden.
"""

from __future__ import annotations

from typing import Any

from policies.errors import InvalidRequest
from policies.schema import ModelSpec

# the chat template's own key for the thinking switch, per family (vLLM and SGLang pass it through)
TEMPLATE_KEY = {
    "qwen3": "enable_thinking",
    "qwen3-moe": "enable_thinking",
    "deepseek-r1-distill": "enable_thinking",
    "glm-4.5": "enable_thinking",
    "hunyuan": "enable_thinking",
    "granite-3.3": "thinking",
}
THINKING_FAMILIES = frozenset(TEMPLATE_KEY)
ALWAYS_THINKING = frozenset({"deepseek-r1", "gemini-2.5-pro"})
# the lowest effort each family takes: o1/o3/o4-mini know no "minimal"; plain chat models
# (gpt-4o and the like, family "openai") take no reasoning_effort at all
LOWEST_EFFORT = {"gpt-5": "minimal", "o-series": "low"}
BY_FAMILY = {"anthropic": "thinking", "gemini-2.5": "gemini_thinking"}


def switch_of(spec: ModelSpec) -> str:
    if spec.reasoning_switch != "auto":
        return spec.reasoning_switch
    if spec.family in THINKING_FAMILIES:
        return "chat_template_kwargs"
    if spec.family in LOWEST_EFFORT:
        return "reasoning_effort"
    if spec.family in ALWAYS_THINKING:
        return "always"
    return BY_FAMILY.get(spec.family, "none")


def apply(body: dict[str, Any], spec: ModelSpec, on: bool) -> tuple[dict[str, Any], str]:
    """The request body with reasoning switched for ``spec``, and the switch used (``client``: the
    request set it itself; ``none``: the model has no switch, ``always``: it cannot stop thinking)."""
    switch = switch_of(spec)
    if switch == "chat_template_kwargs":
        given = body.get("chat_template_kwargs") or {}
        if not isinstance(given, dict):
            raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
        key = TEMPLATE_KEY.get(spec.family, "enable_thinking")
        if key in given:
            return body, "client"
        return {**body, "chat_template_kwargs": {**given, key: on}}, switch
    if switch == "reasoning_effort":
        if "reasoning_effort" in body:
            return body, "client"
        return {**body, "reasoning_effort": "medium" if on else LOWEST_EFFORT.get(spec.family, "low")}, switch
    if switch in ("thinking", "gemini_thinking"):
        if "thinking" in body or "reasoning_effort" in body:
            return body, "client"
        if on:
            return {**body, "thinking": {"type": "enabled", "budget_tokens": spec.thinking_budget}}, switch
        off = {"thinking": {"type": "disabled"}} if switch == "thinking" else {"reasoning_effort": "disable"}
        return {**body, **off}, switch
    return body, switch
