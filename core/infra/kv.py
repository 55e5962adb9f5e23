"""Redis clients with timeouts and retries: an outage or a restart costs a wait, never a hang, and a
stale pooled connection after a restart is retried instead of surfacing as an error."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

TRANSIENT = (ConnectionError, TimeoutError, OSError)

_OPTIONS: dict[str, Any] = {
    "socket_timeout": 15.0,  # longer than any XREAD BLOCK we issue (2 s)
    "socket_connect_timeout": 5.0,
    "health_check_interval": 15,
    "retry_on_error": [ConnectionError, TimeoutError],
}


def client(url: str, **kw: Any) -> redis.Redis:
    from redis.retry import Retry

    return redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 3), **_OPTIONS, **kw)


def async_client(url: str, **kw: Any) -> aioredis.Redis:
    from redis.asyncio.retry import Retry

    return aioredis.Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 3), **_OPTIONS, **kw)
