"""Reload bookkeeping: a dropped backend closes only when no live runtime uses it."""

from __future__ import annotations

import asyncio

from backends.scripted import ScriptedBackend
from gateway.service.runtime import Runtime, RuntimeHolder
from policies import loader

POLICY = loader.parse("version: 1\nbackends: {b: {type: scripted}}\nmodels: {m: {backend: b}}\n")


class Closing(ScriptedBackend):
    def __init__(self, name: str) -> None:
        super().__init__(name, POLICY.backends["b"])
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def rt(**backends: Closing) -> Runtime:
    return Runtime(POLICY, dict(backends), frozenset())


def test_quick_reloads_keep_a_backend_an_old_request_still_uses() -> None:
    async def scenario() -> None:
        x, y = Closing("x"), Closing("y")
        holder = RuntimeHolder(rt(x=x))
        a = holder.acquire()  # a long request pinned to A, using x
        await holder.swap(rt(x=x))  # B keeps x
        await holder.swap(rt(y=y))  # C drops x; B has nothing in flight
        assert not x.closed  # A's request still streams from x
        await holder.release(a)
        assert x.closed and not y.closed

    asyncio.run(scenario())


def test_a_dropped_idle_backend_closes_at_once() -> None:
    async def scenario() -> None:
        x, y = Closing("x"), Closing("y")
        holder = RuntimeHolder(rt(x=x))
        await holder.swap(rt(y=y))
        assert x.closed and not y.closed

    asyncio.run(scenario())
