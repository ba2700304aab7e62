"""The ``litellm`` backend: any provider litellm knows, with triage's replicas, retries and
health around it. litellm's own retries are off (``num_retries=0``) so that one layer retries.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import openai

from backends.base import Body, Call
from backends.openai_compat import OpenAICompatBackend
from backends.remote import upstream_failure
from backends.replicas import ReplicaState
from policies.errors import UpstreamError, UpstreamRejected, UpstreamTimeout


def _litellm() -> Any:
    # heavy, with import-time side effects: imported only when a policy asks for it, and told to
    # use what it bundles (its cost map, Anthropic's beta headers) instead of fetching
    # them over the network at run time
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
    import litellm

    litellm.suppress_debug_info = True
    litellm.telemetry = False  # older releases only (1.110 has no telemetry to turn off)
    return litellm


class LiteLLMBackend(OpenAICompatBackend):
    def _args(self, replica: ReplicaState, call: Call, stream: bool) -> dict[str, Any]:
        t = self.spec.timeouts
        args = {k: v for k, v in call.body.items() if k != "stream"}
        args.update(api_base=replica.api_base, num_retries=0, timeout=t.total_s)
        if call.kind != "embedding":
            args["stream"] = stream
        if replica.api_key:
            args["api_key"] = replica.api_key
        return args

    async def context_length(self, upstream: str) -> int | None:
        return None  # a hosted provider's context: declared in the policy (models.NAME.context_length)

    async def _invoke(self, replica: ReplicaState, call: Call, stream: bool) -> Any:
        lib = _litellm()
        fn = {"chat": lib.acompletion, "completion": lib.atext_completion, "embedding": lib.aembedding}[call.kind]
        try:
            return await fn(**self._args(replica, call, stream))
        except openai.OpenAIError as exc:  # litellm raises the openai SDK's exception classes
            raise _mapped(self.name, exc, self.spec.error_text) from None

    async def _call_once(self, replica: ReplicaState, call: Call) -> Body:
        response = await self._invoke(replica, call, stream=False)
        return response.model_dump(exclude_none=True)

    async def _open_once(self, replica: ReplicaState, call: Call) -> AsyncIterator[Body]:
        response = await self._invoke(replica, call, stream=True)
        return self._chunks(response)

    async def _chunks(self, response: Any) -> AsyncIterator[Body]:
        try:
            async for chunk in response:
                yield chunk.model_dump(exclude_none=True)
        except openai.OpenAIError as exc:
            raise UpstreamError(f"upstream {self.name} failed mid-stream", retryable=False, detail=str(exc)) from None


def _mapped(name: str, exc: openai.OpenAIError, text: str = "generic") -> UpstreamError | UpstreamRejected:
    message = getattr(exc, "message", None) or str(exc)
    if isinstance(exc, openai.APITimeoutError):
        return UpstreamTimeout(f"upstream {name} timed out", detail=message)
    if isinstance(exc, openai.APIConnectionError):
        return UpstreamError(f"cannot reach upstream {name}", detail=message)
    return upstream_failure(name, getattr(exc, "status_code", None) or 502, message, getattr(exc, "code", None), text)


def factory(name: str, spec: Any) -> LiteLLMBackend:
    return LiteLLMBackend(name, spec)
