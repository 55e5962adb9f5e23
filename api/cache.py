"""A tiny per-process cache with single flight: concurrent misses for one key share one lookup.

A thousand clients opening event streams at once would otherwise run a thousand identical
queries for the same key and job, and the API's 60 Postgres connections would run out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._values: dict[Hashable, tuple[float, T]] = {}
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}

    async def get(self, key: Hashable, load: Callable[[], Awaitable[T]]) -> T:
        hit = self._values.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            value = await load()
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody warns about it
            raise
        finally:
            self._inflight.pop(key, None)
        if len(self._values) >= self.max_entries:
            self._values.clear()
        self._values[key] = (time.monotonic() + self.ttl_s, value)
        fut.set_result(value)
        return value

    def forget(self, key: Hashable) -> None:
        self._values.pop(key, None)
