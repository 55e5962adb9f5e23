"""Thread capacity of its own for each kind of blocking work of the API process.

anyio's `to_thread.run_sync` shares one limiter of 40 threads by default: 40 slow uploads, or 40
webhook hosts whose DNS never answers, would leave none for preparing other tenants' requests. Each
kind here has its own `CapacityLimiter` (SPOOL_UPLOAD_THREADS, SPOOL_PREPARE_THREADS,
SPOOL_DNS_THREADS); everything else keeps the default one. Within `prepare` and `dns`, one tenant
holds at most its share at once (SPOOL_PREPARE_PER_TENANT; half the DNS threads): the tenant is named
in `SHARE` by the API's rate gate (api/request_gate.py) for everything its request does, so no route has
to remember it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Callable
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


# Whose share the current request's work comes out of (a tenant id), or None (not a tenant's).
SHARE: ContextVar[int | None] = ContextVar("spool_thread_share", default=None)
_SHARED: frozenset[Kind] = frozenset({"prepare", "dns"})
_SHARES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def share_size(kind: Kind = "prepare") -> int:
    s = get_settings()
    if kind == "prepare":
        return s.prepare_per_tenant or max(1, s.prepare_threads // 2)
    return max(1, s.dns_threads // 2)


def _share(kind: Kind) -> asyncio.Semaphore | None:
    owner = SHARE.get() if kind in _SHARED else None
    if owner is None:
        return None
    per_loop = _SHARES.setdefault(asyncio.get_running_loop(), {})
    sem = per_loop.get((kind, owner))
    if sem is None:
        sem = per_loop[(kind, owner)] = asyncio.Semaphore(share_size(kind))
    return sem


def limiter(kind: Kind) -> CapacityLimiter:
    per_loop = _LIMITERS.setdefault(asyncio.get_running_loop(), {})
    if kind not in per_loop:
        s = get_settings()
        size = {"upload": s.upload_threads, "prepare": s.prepare_threads, "dns": s.dns_threads}[kind]
        per_loop[kind] = CapacityLimiter(size)
    return per_loop[kind]


async def run(kind: Kind, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread, counted against `kind`'s capacity only, and, for `prepare` and
    `dns`, against the share of the tenant whose request this is (`SHARE`). A `dns` call cancelled by
    its caller's deadline returns at once (the system resolver cannot be interrupted), but its thread
    and the tenant's share stay taken until the lookup really ends: a tenant's hung lookups hold its
    own share, never every thread."""
    sem = _share(kind)
    abandon = kind == "dns"
    if sem is None:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter(kind), abandon_on_cancel=abandon)
    await sem.acquire()
    loop = asyncio.get_running_loop()
    lock = threading.Lock()
    state = "waiting"  # -> running -> done, or -> dropped (cancelled before its thread started)

    def owned() -> T:
        nonlocal state
        with lock:
            if state == "dropped":
                raise anyio.get_cancelled_exc_class()()
            state = "running"
        try:
            return fn(*args)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone (a test's, or a shutdown): nothing to free
                loop.call_soon_threadsafe(sem.release)

    try:
        return await anyio.to_thread.run_sync(owned, limiter=limiter(kind), abandon_on_cancel=abandon)
    except BaseException:
        with lock:
            if state == "waiting":  # its thread never started: the share is given back here
                state = "dropped"
                sem.release()
        raise
