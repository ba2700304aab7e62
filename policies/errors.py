"""The one exception tree of triage.

Every error the gateway can answer with is a subclass of :class:`TriageError`; each class
carries its HTTP status and OpenAI error ``type``. The edge (``gateway.http.app``) maps them once to
an OpenAI-shaped body, or to an SSE error event when a stream has already started. Pure code
(``policies/``, ``backends/``) raises these and never builds HTTP responses itself.

The ground floor: it imports nothing of triage, and every package may import it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal


class TriageError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(TriageError):
    status = 400
    type = "invalid_request_error"


class MalformedJSON(InvalidRequest):
    default_code = "invalid_json"


class NothingFits(InvalidRequest):
    """No model the request may go to can take it: its prompt and ``max_tokens`` fit no context,
    or it carries tools or images that none takes (OpenAI's code for the first)."""

    default_code = "context_length_exceeded"


class GuardrailRefused(InvalidRequest):
    """A guardrail of the policy refused the request or its answer (``policies.guardrails``): the
    body names it (``error.guardrail``); a stream is cut with this as its in-band error."""

    default_code = "guardrail_refused"

    def __init__(self, message: str, guardrail: str) -> None:
        super().__init__(message, param=None)
        self.guardrail = guardrail

    def body(self) -> dict[str, Any]:
        out = super().body()
        out["error"]["guardrail"] = self.guardrail
        return out


class ClientGone(TriageError):
    """The client closed the connection before the answer was ready (nginx's 499): the work for
    it was stopped. Nobody reads this answer; the status is for logs and metrics."""

    status = 499
    type = "client_closed_request"
    default_code = "client_closed_request"


class Unauthorized(TriageError):
    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"


class ModelNotFound(TriageError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class NotFound(TriageError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class Conflict(TriageError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(TriageError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class RequestTimeout(TriageError):
    """The request's body did not arrive in time (a stalled or trickling client)."""

    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


class RateLimited(TriageError):
    status = 429
    type = "rate_limit_exceeded"
    default_code = "concurrency_limit"


class KeyRateLimited(RateLimited):
    """A key's requests or tokens per minute are used up; ``retry_after`` says when a slot frees."""

    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BudgetExhausted(TriageError):
    """A key's budget is spent. 429 with OpenAI's own code for it (``insufficient_quota``): the
    official clients raise RateLimitError and, told ``x-should-retry: false``, do not retry."""

    status = 429
    type = "insufficient_quota"
    default_code = "insufficient_quota"

    def __init__(self, message: str, *, spent: float, budget: float, resets_at: str, retry_after: float) -> None:
        super().__init__(message)
        self.spent, self.budget, self.resets_at, self.retry_after = spent, budget, resets_at, retry_after


class Forbidden(TriageError):
    status = 403
    type = "invalid_request_error"
    default_code = "model_not_allowed"


class NotReady(TriageError):
    status = 503
    type = "server_error"
    default_code = "not_ready"


class TooManyConnections(NotReady):
    """The server holds its ``limits.max_connections``: a new one is answered and closed at once."""

    default_code = "too_many_connections"


class UpstreamError(TriageError):
    """The upstream answered with an error, refused the connection, or died.

    ``message`` goes to the client and names no address or credential; ``detail`` (what the
    upstream said, which host refused) goes to the log only."""

    status = 502
    type = "upstream_error"
    default_code = "bad_gateway"

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        upstream_status: int | None = None,
        detail: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retryable = retryable
        self.upstream_status = upstream_status
        self.detail = detail
        self.retry_after_s = retry_after_s  # a 429's or 503's `retry-after`: how long the replica asked to be left


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout"
    default_code = "upstream_timeout"


_CONTENT = ("content_filter", "content_policy_violation", "content_policy", "safety")


ErrorClass = Literal["context_window", "rate_limit", "content_policy", "timeout", "server_error"]


def error_class(exc: TriageError) -> ErrorClass | None:
    """Why an upstream call failed, as a policy's ``fallbacks_on`` names it: ``context_window``,
    ``rate_limit``, ``content_policy``, ``timeout``, ``server_error``; None for a refusal of the
    request itself (any other 4xx: the client's fault, no fallback)."""
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    if isinstance(exc, UpstreamRejected):
        if exc.code == "context_length_exceeded":
            return "context_window"
        if exc.code in _CONTENT or "content management policy" in exc.detail.lower():
            return "content_policy"
        return None
    if isinstance(exc, UpstreamError):
        return "rate_limit" if exc.upstream_status == 429 else "server_error"
    return None


class UpstreamRejected(TriageError):
    """The upstream refused the request itself (a 4xx): the client's fault; its status passes through."""

    type = "invalid_request_error"

    def __init__(
        self, message: str, *, status: int, param: str | None = None, code: str | None = None, detail: str = ""
    ):
        super().__init__(message, param=param, code=code)
        self.status = status  # type: ignore[misc]
        self.detail = detail  # what the upstream said: for the log only


class PolicyInvalid(TriageError):
    """A policy file failed to load or validate; carries every problem found."""

    status = 500
    type = "server_error"
    default_code = "policy_invalid"

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid policy:\n" + "\n".join(problems))
        self.problems = problems


class EngineCrashed(UpstreamError):
    """A local engine's worker process died while it held the request (a native fault, an
    out-of-memory kill): the gateway is unharmed and the worker restarts."""

    default_code = "engine_crashed"

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class EngineUnavailable(UpstreamError):
    """A local engine cannot serve: its file does not load, or its worker keeps dying at load."""

    status = 503
    type = "server_error"
    default_code = "engine_unavailable"


class CrashingRequest(UpstreamError):
    """The same request (its content, as it reached the engine) crashed a local engine moments
    ago: refused for a while rather than sent into another crash. A 400, so that clients do not
    retry it; an UpstreamError, so that a fallback model down the chain may still take it."""

    status = 400
    type = "invalid_request_error"
    default_code = "request_crashed_engine"

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class CrashCooldown(KeyRateLimited):
    """A key's requests crashed local engines again and again: the engines refuse it for a while."""

    default_code = "engine_crash_cooldown"
