"""The gateway in a program's own process, async: :class:`AsyncGateway` opens a policy, starts its
runtime as ``triage serve`` does (``gateway.service.assemble.build``: its backends, local engines in
their worker processes, the encoder, the state store) and offers the service's verbs
(:class:`gateway.service.service.Service`), each taking the body its HTTP route takes, as a dict or
as keywords. What they return is plain data: a completion or embeddings body as the HTTP edge
sends it, the cascade's :class:`~policies.cascade.Decision`, a :class:`Routing`. What they raise is
the triage error tree (:mod:`policies.errors`: each error's ``status`` and ``code`` are the ones the
HTTP edge would answer with).

No key is asked: the program is the gateway's operator. Keys, rate limits, spend and the request
log are the HTTP edge's; the policy's caches, quality watch and escalation budget work as served.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from gateway.service import assemble, decisions, embeddings, pipeline
from gateway.service.bodies import from_program
from gateway.service.context import Context
from gateway.service.messages import text as message_text
from gateway.service.runtime import Runtime, RuntimeHolder
from gateway.service.service import Service
from policies import loader
from policies.cascade import Decision
from policies.errors import InvalidRequest, NotReady
from policies.fit import shape_of
from policies.plans import EncoderPlan, TypedPlan, resolve
from policies.schema import Policy, RoutedModel, SemanticModel
from policies.semantic import Route

if TYPE_CHECKING:
    from classifiers.service import Classification

PolicySource = str | os.PathLike[str] | Policy
Prompt = str | Sequence[Mapping[str, Any]]
SURFACE = "python"  # the door a request of this API came in by (a context's `surface`)


@dataclass(frozen=True, slots=True)
class Routing:
    """What the policy would do with a prompt, without generating: the model that would serve it
    and the models after it, the encoder's decision, and its reading of the prompt's last user turn."""

    requested: str | None  # the name routed for (None: none named, and the policy routes by none)
    model: str | None  # the model that would serve the prompt (the head of ``chain``)
    chain: tuple[str, ...]  # the models tried in order, each after the one before fails
    route: Route | None  # the encoder's decision (None: a model or an alias: no choice is made)
    reading: Classification | None  # every head's answer and the guard's (None: the policy has no classifier)
    latency_ms: float  # the route's time, the encoder's pass included (not the reading's)


class AsyncGateway:
    """A policy served in-process, async. ``policy``: a policy file (a path), a policy's YAML text
    (a ``str`` holding a line break) or a loaded :class:`~policies.schema.Policy`; ``base_dir``: the
    folder its relative paths are read from (default: the file's folder, else the working folder);
    ``engines`` False: the backends are not started (no engine, no worker process): the gateway
    routes and serves the encoder's embeddings, and the other verbs raise
    :class:`~policies.errors.NotReady`.

    The policy is read and checked here (:class:`~policies.errors.PolicyInvalid`); nothing starts
    before :meth:`open` (or ``async with``), and :meth:`aclose` stops what it started."""

    def __init__(self, policy: PolicySource, *, base_dir: str | os.PathLike[str] | None = None, engines: bool = True):
        self.policy, self._source, self._base_dir = _read(policy, Path(base_dir) if base_dir is not None else None)
        self._engines = engines
        self._holder: RuntimeHolder | None = None

    async def open(self) -> AsyncGateway:
        """Start the runtime (its backends, the encoder, the state store); once."""
        if self._holder is not None:
            raise NotReady("this gateway is open already")
        rt = await assemble.build(self.policy, None, self._base_dir, self._source, engines=self._engines)
        self._holder = RuntimeHolder(rt)
        return self

    async def aclose(self) -> None:
        """Stop the runtime: its backends (their worker processes), the encoder, the store."""
        holder, self._holder = self._holder, None
        if holder is not None:
            await holder.close()

    async def __aenter__(self) -> AsyncGateway:
        return await self.open()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def runtime(self) -> Runtime:
        """The started runtime; :class:`~policies.errors.NotReady` when the gateway is not open."""
        if self._holder is None:
            raise NotReady("the gateway is not open: use `with Gateway(...)` (or `async with`), or call open()")
        return self._holder.current

    @property
    def service(self) -> Service:
        """The service the verbs call (for what they do not cover)."""
        return Service(self.runtime)

    async def generate(
        self, body: Mapping[str, Any] | None = None, /, *, kind: Literal["chat", "completion"] = "chat", **fields: Any
    ) -> dict[str, Any]:
        """A chat completion (``kind`` "completion": a text completion), its body as
        ``POST /v1/chat/completions`` takes it (``model``, ``messages``, ...), whole: ``stream``
        is refused. The answer is the completion's body; its ``model`` is the model that answered."""
        request = _body(body, fields)
        if request.get("stream"):
            raise InvalidRequest("the Python API answers whole: send no `stream`", param="stream")
        out = await self._service().generate(kind, request, _context())
        answer = out.whole
        assert answer is not None, "not streamed: a whole answer"
        return answer

    async def decide(self, body: Mapping[str, Any] | None = None, /, **fields: Any) -> Decision:
        """The cascade's decision on a typed question, as ``POST /v1/decide`` takes it: ``question``,
        ``type`` (choice, yes_no, score), ``options``, ``context``, ``scale``, ``task``,
        ``policy_overrides``. :class:`~policies.errors.NotFound` when the policy has no cascade."""
        service = self._service()
        plan = decisions.plan(service.rt, None)  # no key: every tier may be asked
        question, overrides = decisions.parse(_body(body, fields), plan)
        return await service.decide(question, overrides, _context(), plan)

    async def embed(self, body: Mapping[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
        """Embeddings, as ``POST /v1/embeddings`` takes them (``model``, ``input``, ...): the
        encoder's (its model is named ``all-minilm-l6-v2``) or a policy model's engine's. The answer
        is OpenAI's embeddings body."""
        request = _body(body, fields)
        rt = self.runtime
        encoder = rt.policy.classifier is not None and request.get("model") == embeddings.model_name(
            rt.policy.classifier
        )
        out = await self._service(engines=not encoder).embed(request, _context())
        answer = out.whole
        assert answer is not None, "embeddings are whole"
        return answer

    async def route(self, prompt: Prompt, model: str | None = None) -> Routing:
        """Where the policy would send ``prompt`` (a user turn, or a list of chat messages), asked
        of ``model`` (default: the policy's first semantic virtual model, else its first routed
        one), without generating: the encoder's decision as the server makes it, and its reading of
        the last user turn. A cascade model routes as its open route (an untyped prompt's)."""
        rt = self.runtime
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        body: dict[str, Any] = {"messages": turns}
        name = model if model is not None else _routes_by(rt.policy)
        t0 = time.perf_counter()
        route: Route | None = None
        chain: tuple[str, ...] = ()
        if name is not None:
            plan = resolve(rt.policy, name)
            if isinstance(plan, TypedPlan):
                plan = plan.open
            if isinstance(plan, EncoderPlan):
                route = await pipeline.route_of(rt, plan, "chat", body, shape_of("chat", body))
            chain = resolve(rt.policy, route.model).chain if route is not None else plan.chain
        latency_ms = (time.perf_counter() - t0) * 1000
        reading = None
        if rt.encoding is not None:
            last = next((message_text(t.get("content")) for t in reversed(turns) if t.get("role") == "user"), "")
            reading = await asyncio.to_thread(rt.encoding.classifier.classify, last)
        return Routing(name, chain[0] if chain else None, chain, route, reading, latency_ms)

    def _service(self, *, engines: bool = True) -> Service:
        """The service, for a verb that needs the engines started (``engines``) or not."""
        if engines and not self._engines:
            raise NotReady("this gateway was opened with engines=False: it routes, and embeds with the encoder only")
        return self.service


def _read(policy: PolicySource, base_dir: Path | None) -> tuple[Policy, Path | None, Path]:
    """The policy, its file (None: a text or an object) and the folder its paths are relative to."""
    if isinstance(policy, Policy):
        return policy, None, base_dir or Path.cwd()
    if isinstance(policy, str) and "\n" in policy:
        folder = (base_dir or Path.cwd()).resolve()
        return loader.parse(policy, "<policy>", folder), None, folder
    path = Path(policy).resolve()
    return loader.load(path), path, base_dir or path.parent


def _routes_by(policy: Policy) -> str | None:
    """The policy's first semantic virtual model, else its first routed one."""
    for kind in (SemanticModel, RoutedModel):
        if (name := next((n for n, vm in policy.virtual_models.items() if isinstance(vm, kind)), None)) is not None:
            return name
    return None


def _body(body: Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A verb's body: the mapping given and the keywords (a keyword wins), as an HTTP body would
    arrive (:func:`gateway.service.bodies.from_program`: JSON values only, no text that cannot be
    written as UTF-8, a fresh copy: the caller's is never written to)."""
    return from_program({**(body or {}), **fields})


def _context() -> Context:
    return Context(f"py-{uuid.uuid4().hex[:24]}", surface=SURFACE)
