"""Redis clients with timeouts and retries: an outage or a restart costs a wait, never a hang, and a
stale pooled connection after a restart is retried instead of surfacing as an error."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, NoScriptError, TimeoutError

# Every Redis client of ours is built here: importing transient registers Redis's refusals for now
# (MISCONF, BUSY, NOREPLICAS) with redis-py, so that `except transient.REDIS:` catches them.
from core.infra import transient  # noqa: F401

# TCP keepalives on every Redis connection (ours and the Celery consumer's): a Redis host that vanishes
# (no FIN, no RST) is found dead on an idle connection in ~25 s, not TCP's two hours.
# (TCP_KEEPIDLE is Linux's name; macOS calls it TCP_KEEPALIVE. A unix:// socket takes none of this.)
_IDLE = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))
KEEPALIVE: dict[str, Any] = {
    "socket_keepalive": True,
    "socket_keepalive_options": {
        opt: value
        for opt, value in (
            (_IDLE, 10),
            (getattr(socket, "TCP_KEEPINTVL", None), 5),
            (getattr(socket, "TCP_KEEPCNT", None), 3),
        )
        if opt is not None
    },
}

_OPTIONS: dict[str, Any] = {
    "socket_timeout": 15.0,  # longer than any XREAD BLOCK we issue (2 s)
    "socket_connect_timeout": 5.0,
    "health_check_interval": 15,
    "retry_on_error": [ConnectionError, TimeoutError],
}


def _options(url: str) -> dict[str, Any]:
    return _OPTIONS if url.startswith("unix://") else {**_OPTIONS, **KEEPALIVE}


def client(url: str, **kw: Any) -> redis.Redis:
    from redis.retry import Retry

    return redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 3), **_options(url), **kw)


def async_client(url: str, **kw: Any) -> aioredis.Redis:
    from redis.asyncio.retry import Retry

    return aioredis.Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 3), **_options(url), **kw)


class Lua:
    """A Lua script called by its digest (EVALSHA): its text goes over the wire only when the server
    does not have it (a restarted Redis answers NOSCRIPT; EVAL then caches it again). EVAL sent the
    whole text on every call, and Redis hashed it every time: the admission script is 3.7 KB, sent
    twice per request. redis-py's `Script` needs a client bound at creation; these are module-level
    and called with whichever client (sync or asyncio) the caller holds. In a pipeline a NOSCRIPT
    would only surface at `execute`, so pipelines send `text` with EVAL."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, rds: Any, keys: Sequence[Any], *args: Any) -> Any:
        try:
            return rds.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return rds.eval(self.text, len(keys), *keys, *args)

    async def run_async(self, rds: Any, keys: Sequence[Any], *args: Any) -> Any:
        try:
            return await rds.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await rds.eval(self.text, len(keys), *keys, *args)
