"""Thread capacity of its own for each kind of blocking work of the API process.

anyio's `to_thread.run_sync` shares one limiter of 40 threads by default: 40 slow uploads, or 40
webhook hosts whose DNS never answers, would leave none for preparing other tenants' requests. Each
kind here has its own `CapacityLimiter` (SPOOL_UPLOAD_THREADS, SPOOL_PREPARE_THREADS,
SPOOL_DNS_THREADS); everything else keeps the default one.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
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


def limiter(kind: Kind) -> CapacityLimiter:
    per_loop = _LIMITERS.setdefault(asyncio.get_running_loop(), {})
    if kind not in per_loop:
        s = get_settings()
        size = {"upload": s.upload_threads, "prepare": s.prepare_threads, "dns": s.dns_threads}[kind]
        per_loop[kind] = CapacityLimiter(size)
    return per_loop[kind]


async def run(kind: Kind, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread, counted against `kind`'s capacity only."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter(kind))
