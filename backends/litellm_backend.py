"""The ``litellm`` backend: any provider litellm knows, with triage's replicas, retries and
health around it. litellm's own retries are off (``num_retries=0``) so that one layer retries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from backends.base import Body, Call
from backends.openai_compat import OpenAICompatBackend
from backends.registry import register
from backends.replicas import ReplicaState
from gateway.errors import UpstreamError, UpstreamRejected, UpstreamTimeout


def _litellm() -> Any:
    import litellm  # heavy, with import-time side effects: only when a policy asks for it

    litellm.suppress_debug_info = True
    return litellm


class LiteLLMBackend(OpenAICompatBackend):
    def _args(self, replica: ReplicaState, call: Call, stream: bool) -> dict[str, Any]:
        t = self.spec.timeouts
        args = {k: v for k, v in call.body.items() if k != "stream"}
        args.update(api_base=replica.api_base, stream=stream, num_retries=0, timeout=t.total_s)
        if replica.api_key:
            args["api_key"] = replica.api_key
        return args

    async def _invoke(self, replica: ReplicaState, call: Call, stream: bool) -> Any:
        lib = _litellm()
        fn = lib.acompletion if call.kind == "chat" else lib.atext_completion
        try:
            return await fn(**self._args(replica, call, stream))
        except lib.exceptions.Timeout as exc:
            raise UpstreamTimeout(f"upstream {self.name} timed out: {exc}") from None
        except lib.exceptions.APIConnectionError as exc:
            raise UpstreamError(f"cannot reach upstream {self.name}: {exc}") from None
        except lib.exceptions.APIError as exc:
            raise _mapped(self.name, exc) from None
        except lib.exceptions.OpenAIError as exc:
            raise _mapped(self.name, exc) from None

    async def _call_once(self, replica: ReplicaState, call: Call) -> Body:
        response = await self._invoke(replica, call, stream=False)
        return response.model_dump(exclude_none=True)

    async def _open_once(self, replica: ReplicaState, call: Call) -> AsyncIterator[Body]:
        response = await self._invoke(replica, call, stream=True)
        return self._chunks(response)

    async def _chunks(self, response: Any) -> AsyncIterator[Body]:
        lib = _litellm()
        try:
            async for chunk in response:
                yield chunk.model_dump(exclude_none=True)
        except lib.exceptions.OpenAIError as exc:
            raise UpstreamError(f"upstream {self.name} failed mid-stream: {exc}", retryable=False) from None


def _mapped(name: str, exc: Any) -> UpstreamError | UpstreamRejected:
    status = getattr(exc, "status_code", None) or 502
    message = getattr(exc, "message", None) or str(exc)
    if status >= 500 or status == 429:
        return UpstreamError(f"upstream {name} answered {status}: {message}", upstream_status=status)
    return UpstreamRejected(message, status=status)


@register("litellm")
def _build(name: str, spec: Any) -> LiteLLMBackend:
    return LiteLLMBackend(name, spec)
