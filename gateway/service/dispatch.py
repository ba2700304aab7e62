"""Send one request down its model chain: the model, its fallbacks, the policy's fallback.

Replica retries happen inside each backend; this moves to the next model when a backend has
given up (an upstream error or timeout). A request the upstream rejected (4xx) is not retried. A
model that cannot take the request (its context, tools, images: ``gateway.service.fitting``) is
skipped, and said so; when none down the chain can, the request is a 400, never sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from backends.base import Attempt, Body, Call, ChunkStream, Completion, Kind
from gateway.obs import tracing
from gateway.service import fitting
from gateway.service.runtime import Runtime
from policies import reasoning
from policies.errors import UpstreamError
from policies.fit import Shape, nothing_fits
from policies.semantic import Route

log = structlog.get_logger("triage.dispatch")


@dataclass
class Served:
    model: str
    backend: str
    replica: str
    completion: Completion | None = None
    stream: ChunkStream | None = None
    route: Route | None = None
    reasoning_switch: str | None = None
    skipped: tuple[tuple[str, str], ...] = ()  # models down the chain that could not take it, and why


async def dispatch(
    rt: Runtime,
    kind: Kind,
    body: Body,
    request_id: str,
    attempts: list[Attempt],
    chain: Sequence[str],
    route: Route | None = None,
    affinity: str | None = None,
    shape: Shape | None = None,
) -> Served:
    """The first model of ``chain`` that answers; ``route``, when the encoder chose the chain's head,
    switches reasoning per candidate and is kept in what is served; ``shape``: what the request
    needs of a model (None: not checked)."""
    last: UpstreamError | None = None
    skipped: list[tuple[str, str]] = []
    for name in chain:
        spec = rt.policy.models[name]
        backend = rt.backends[spec.backend]
        if kind == "embedding" and not backend.capabilities.embeddings:
            continue  # this backend has no embeddings API: the next model down the chain
        if shape is not None and (why := await fitting.refusal(rt, name, shape)) is not None:
            skipped.append((name, why))
            log.info("model_skipped", request_id=request_id, model=name, reason=why, next=_after(chain, name))
            continue
        upstream_body, switch = {**body, "model": rt.policy.upstream_name(name)}, None
        if route is not None and route.apply_reasoning:
            upstream_body, switch = reasoning.apply(upstream_body, spec, route.reasoning)
        elif route is not None:
            switch = "engine"  # the candidate leaves reasoning to the engine's default
        if upstream_body.get("stream") is True and kind in ("chat", "completion"):
            # every stream is counted: the engine is asked for its usage whether the client did or not
            # (gateway.service.keys.metering: the client gets the usage chunk only when it asked)
            upstream_body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        call = Call(kind, upstream_body, request_id, attempts, affinity)
        try:
            if call.stream:
                stream = await tracing.upstream(backend.open_stream, call, backend.name, name, chain)
                return Served(name, backend.name, stream.replica, None, stream, route, switch, tuple(skipped))
            completion = await tracing.upstream(backend.complete, call, backend.name, name, chain)
            return Served(name, backend.name, completion.replica, completion, None, route, switch, tuple(skipped))
        except UpstreamError as exc:
            last = exc
            log.warning(
                "model_failed",
                request_id=request_id,
                model=name,
                backend=backend.name,
                error=exc.message,
                next=_after(chain, name),
            )
    if last is None and skipped:
        raise nothing_fits(f"the model '{body.get('model')}' may go to", skipped, "messages")
    if last is None:
        raise UpstreamError(f"no model down the chain of '{body['model']}' could take the request", retryable=False)
    raise last


def _after(chain: Sequence[str], name: str) -> str | None:
    i = chain.index(name)
    return chain[i + 1] if i + 1 < len(chain) else None
