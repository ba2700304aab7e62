"""Send one request down its model chain: the model, its fallbacks, the policy's fallback.

Replica retries happen inside each backend; this moves to the next model when a backend has
given up (an upstream error or timeout). A request the upstream rejected (4xx) is not retried.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from backends.base import Attempt, Body, Call, ChunkStream, Completion, Kind
from gateway.errors import UpstreamError
from gateway.runtime import Runtime
from policies.routing import candidates

log = structlog.get_logger("triage.dispatch")


@dataclass
class Served:
    model: str
    backend: str
    replica: str
    completion: Completion | None = None
    stream: ChunkStream | None = None


async def dispatch(rt: Runtime, kind: Kind, body: Body, request_id: str, attempts: list[Attempt]) -> Served:
    chain = candidates(rt.policy, body["model"])
    last: UpstreamError | None = None
    for name in chain:
        backend = rt.backends[rt.policy.models[name].backend]
        call = Call(kind, {**body, "model": rt.policy.upstream_name(name)}, request_id, attempts)
        try:
            if call.stream:
                stream = await backend.open_stream(call)
                return Served(name, backend.name, stream.replica, stream=stream)
            completion = await backend.complete(call)
            return Served(name, backend.name, completion.replica, completion=completion)
        except UpstreamError as exc:
            last = exc
            log.warning("model_failed", request_id=request_id, model=name, backend=backend.name,
                        error=exc.message, next=_after(chain, name))
    assert last is not None
    raise last


def _after(chain: list[str], name: str) -> str | None:
    i = chain.index(name)
    return chain[i + 1] if i + 1 < len(chain) else None
