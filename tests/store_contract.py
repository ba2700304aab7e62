"""The harness of the stores' contract suites (``tests/batch/test_batch_contract.py``,
``tests/state/test_quality_store.py``): each family's suite runs the same assertions on every engine,
SQLite and PostgreSQL (on a real server: the ``database`` fixture, marked ``fleet``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import pytest

from gateway.state.stores import StoreDown


class Closable(Protocol):
    async def close(self) -> None: ...


S = TypeVar("S", bound=Closable)


@dataclass(frozen=True)
class Engine(Generic[S]):
    """One engine of a contract: ``open`` a store on it (as often as a test asks: the same data)."""

    name: str
    open: Callable[[], Awaitable[S]]

    def check(self, scenario: Callable[[S], Awaitable[None]]) -> None:
        """``scenario`` on a store opened for it, closed after."""

        async def go() -> None:
            store = await self.open()
            try:
                await scenario(store)
            finally:
                await store.close()

        asyncio.run(go())

    def check_down(self, what: str, *calls: Callable[[S], Awaitable[object]]) -> None:
        """The store says where it is (``<engine> at ...``); once it cannot answer (closed), each of
        ``calls`` is :class:`StoreDown` naming it: ``what`` ("the batch store") and the engine."""

        async def go() -> None:
            store = await self.open()
            assert getattr(store, "where", "").startswith(f"{self.name} at ")
            await store.close()
            for call in calls:
                with pytest.raises(StoreDown, match=rf"{what} \({self.name}"):
                    await call(store)

        asyncio.run(go())


def engines(
    sqlite: Callable[[Path], Awaitable[S]], postgresql: Callable[[str, Path], Awaitable[S]]
) -> Callable[..., Engine[S]]:
    """The fixture ``engine`` of a family's suite, one test a engine: ``sqlite(folder)`` and
    ``postgresql(dsn, folder)`` open its store (``folder``: the test's own)."""

    @pytest.fixture(name="engine", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.fleet)])
    def engine(request: Any, tmp_path: Path) -> Engine[S]:
        if request.param == "sqlite":
            return Engine("sqlite", lambda: sqlite(tmp_path))
        dsn: str = request.getfixturevalue("database")
        return Engine("postgresql", lambda: postgresql(dsn, tmp_path))

    return engine
