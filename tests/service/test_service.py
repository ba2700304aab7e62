"""The service's verbs in process, on scripted engines, beside the HTTP tests (issue 52): a request
is built once and the caller's body is never written; the response cache and the quality watch are
layers composed once when the runtime is assembled; a decision is planned once and that plan is
what every later step reads; a batch of questions keeps each item's error."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from gateway.service import assemble, decisions
from gateway.service import job as jobs
from gateway.service import service as core
from gateway.service.context import Context
from gateway.service.runtime import Runtime
from gateway.service.service import Service
from policies import loader
from policies.cascade import Decision
from policies.errors import Forbidden, InvalidRequest, NotFound
from policies.schema import ApiKey

T = TypeVar("T")
HI = [{"role": "user", "content": "hi"}]
POLICY = """version: 1
backends: {cheap: {type: scripted, text: "B"}, dear: {type: scripted, text: "B"}}
models: {cheap: {backend: cheap}, dear: {backend: dear}}
cascade:
  tiers:
    - {name: first, type: model, model: cheap, logprobs: false, assumed_confidence: 0.6, thresholds: {choice: 0.7}}
    - {name: last, type: model, model: dear, logprobs: false}
"""
CACHED = POLICY + "response_cache: {ttl_s: 600}\n"


def run(policy_text: str, work: Callable[[Runtime], Awaitable[T]]) -> T:
    """``work`` on a runtime assembled from ``policy_text`` (its backends started, then closed)."""

    async def go() -> T:
        rt = await assemble.build(loader.parse(policy_text))
        try:
            return await work(rt)
        finally:
            await rt.settled()
            for backend in rt.backends.values():
                await backend.close()

    return asyncio.run(go())


def test_a_request_is_built_once_and_the_callers_body_is_not_written() -> None:
    body: dict[str, Any] = {"model": "cheap", "messages": HI, "stream": False, "temperature": 0}
    sent = copy.deepcopy(body)

    async def work(rt: Runtime) -> Any:
        return await Service(rt).generate("chat", body, Context("r1"))

    out = run(POLICY, work)
    assert body == sent  # nothing written into what the caller sent
    assert out.served.model == "cheap" and out.whole["choices"][0]["message"]["content"] == "B"
    job = jobs.make(loader.parse(POLICY), "chat", body)
    with pytest.raises(TypeError):
        job.body["model"] = "dear"  # type: ignore[index]  # the job's body is read-only
    assert job.upstream("upstream-name")["model"] == "upstream-name" and job.body["model"] == "cheap"
    with pytest.raises(InvalidRequest) as bad:
        jobs.make(loader.parse(POLICY), "chat", {"model": "cheap", "messages": HI, "stream": "yes"})
    assert bad.value.param == "stream"


def test_the_cache_is_a_layer_composed_once_when_the_runtime_is_assembled() -> None:
    assert assemble.layered(loader.parse(POLICY)) is core.serve  # no cache, no watch: the core alone

    async def work(rt: Runtime) -> list[str | None]:
        assert rt.serve is not None and rt.serve is not core.serve  # composed at assembly
        service, notes = Service(rt), []
        for i in range(2):
            out = await service.generate("chat", {"model": "cheap", "messages": HI, "temperature": 0}, Context(f"r{i}"))
            notes.append(out.cache.result if out.cache is not None else None)
            await asyncio.gather(*list(rt._tasks))  # the answer is kept off the request's path
        return notes

    assert run(CACHED, work) == ["miss", "hit"]


def test_a_decision_is_planned_once_and_its_plan_read_after() -> None:
    policy = loader.parse(POLICY)

    async def work(rt: Runtime) -> tuple[Decision, list[Decision | Exception]]:
        plan = decisions.plan(rt, None)
        assert plan.spec is rt.policy.cascade and [t.name for t in plan.spec.tiers] == ["first", "last"]
        assert plan.shut == {} and plan.tasks == frozenset()
        q, overrides = decisions.parse({"question": "A or B?", "type": "choice", "options": ["A", "B"]}, plan)
        one = await Service(rt).decide(q, overrides, Context("d1"), plan)
        items = decisions.parse_many(
            [{"question": "A or B?", "type": "choice", "options": ["A", "B"]}, {"question": "", "type": "choice"}],
            plan,
        )
        assert isinstance(items[1], InvalidRequest) and items[1].param == "question"  # the item's own error
        good = [i for i in items if not isinstance(i, InvalidRequest)]
        return one, await Service(rt).decide_many(good, Context("d2"), plan)

    one, many = run(POLICY, work)
    assert one.answer == "B" and [d.answer for d in many if isinstance(d, Decision)] == ["B"]
    with pytest.raises(InvalidRequest):
        decisions.parse_many({"questions": []}, decisions.Plan(policy.cascade, {}, frozenset()))  # type: ignore[arg-type]


def test_a_decision_plan_refuses_what_the_door_would() -> None:
    no_cascade = "version: 1\nbackends: {b: {type: scripted}}\nmodels: {m: {backend: b}}\n"
    with pytest.raises(NotFound):
        run(no_cascade, lambda rt: _now(decisions.plan(rt, None)))
    key = ApiKey(name="k", sha256="0" * 64, models=["other"])  # a key that may reach no tier of the cascade
    with pytest.raises(Forbidden):
        run(POLICY, lambda rt: _now(decisions.plan(rt, key)))


async def _now(value: T) -> T:
    return value
