"""Thread capacity of its own for each kind of blocking work of the API process.

anyio's `to_thread.run_sync` shares one limiter of 40 threads by default: 40 slow uploads, or 40
webhook hosts whose DNS never answers, would leave none for preparing other tenants' requests. Each
kind here has its own `CapacityLimiter` (SPOOL_UPLOAD_THREADS, SPOOL_PREPARE_THREADS,
SPOOL_DNS_THREADS); everything else keeps the default one. Within `prepare`, one tenant holds at most
its share (SPOOL_PREPARE_PER_TENANT) at once: the tenant is named in `SHARE` by the API's rate gate
(api/ratelimit.py) for everything its request does, so no route has to remember it.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Literal, TypeVar

import anyio
from anyio import CapacityLimiter

from core.config import get_settings

T = TypeVar("T")
Kind = Literal["upload", "prepare", "dns"]

# Per event loop: a limiter belongs to the loop it was first used on (tests run several loops).
_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, CapacityLimiter]] = (
    weakref.WeakKeyDictionary()
)


# Whose share the current request's prepare work comes out of (a tenant id), or None (not a tenant's).
SHARE: ContextVar[int | None] = ContextVar("spool_prepare_share", default=None)
_SHARES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def share_size() -> int:
    s = get_settings()
    return s.prepare_per_tenant or max(1, s.prepare_threads // 2)


@contextlib.asynccontextmanager
async def _share(kind: Kind) -> AsyncIterator[None]:
    owner = SHARE.get() if kind == "prepare" else None
    if owner is None:
        yield
        return
    per_loop = _SHARES.setdefault(asyncio.get_running_loop(), {})
    sem = per_loop.get(owner)
    if sem is None:
        sem = per_loop[owner] = asyncio.Semaphore(share_size())
    async with sem:
        yield


def limiter(kind: Kind) -> CapacityLimiter:
    per_loop = _LIMITERS.setdefault(asyncio.get_running_loop(), {})
    if kind not in per_loop:
        s = get_settings()
        size = {"upload": s.upload_threads, "prepare": s.prepare_threads, "dns": s.dns_threads}[kind]
        per_loop[kind] = CapacityLimiter(size)
    return per_loop[kind]


async def run(kind: Kind, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread, counted against `kind`'s capacity only (and, for `prepare`,
    against the share of the tenant whose request this is)."""
    async with _share(kind):
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter(kind))
