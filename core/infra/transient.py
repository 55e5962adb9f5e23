"""What "Postgres or Redis unavailable" means, written once (issues 35 and 36).

Such a fault is waited out, never turned into a failed job or a 500: the API answers 503 with
Retry-After (api/errors.py), workers pause with a bounded backoff (core/infra/backoff.py) and let
the job go if it lasts (workers/retry.py), the dispatcher tries again at its next tick. Everything
else is a real error.

Unavailable is more than unreachable. A Redis that answers can still refuse every write for a while:

- `MISCONF`: it cannot persist to disk (a full disk) and stops writes until a save succeeds;
- `OOM`: over `maxmemory` with `noeviction` (docker-compose.yml: queues and streams are never evicted);
- `READONLY`: the server we reach became a replica after a failover;
- `LOADING` (a restart reading its data back), `BUSY` (a script past its time limit), `MASTERDOWN`,
  `NOREPLICAS` (fewer replicas than `min-replicas-to-write`), `TRYAGAIN`, `CLUSTERDOWN`.

redis-py gives most of these a class of their own (`OutOfMemoryError`, `ReadOnlyError`,
`BusyLoadingError`, ...) but answers `MISCONF`, `BUSY` and `NOREPLICAS` as a plain `ResponseError`,
which also stands for our own bugs (`WRONGTYPE`, a failing script). So that `except TRANSIENT:`
catches exactly the refusals, this module registers `RedisRefused` for the codes redis-py leaves
unmapped, in the parser table every redis-py client reads (sync, asyncio, hiredis or not). It is
imported by core/infra/kv.py, through which every Redis client of ours is built. `is_transient`
also recognises a refusal by its code when it reached us as a plain `ResponseError` (a client
built before this import, or an error re-raised by another library).
"""

from __future__ import annotations

import psycopg
from redis import exceptions as rx
from redis._parsers.base import BaseParser
from sqlalchemy import exc as sx

# The reply codes with which a reachable Redis refuses a command for now, not for good.
REDIS_REFUSALS = frozenset(
    ("MISCONF", "OOM", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "NOREPLICAS", "TRYAGAIN", "CLUSTERDOWN")
)


class RedisRefused(rx.ResponseError):
    """A Redis refusal redis-py has no class for (`MISCONF`, `BUSY`, `NOREPLICAS`): the server is
    there but serves no writes for now. A `ResponseError`, as redis-py would have raised."""


def _register() -> None:
    table = BaseParser.EXCEPTION_CLASSES
    for code in REDIS_REFUSALS:
        table.setdefault(code, RedisRefused)  # redis-py's own class where it has one


_register()

# Redis unreachable, timing out, or refusing for now.
REDIS: tuple[type[BaseException], ...] = (
    rx.ConnectionError,  # BusyLoadingError (LOADING) is one
    rx.TimeoutError,
    OSError,
    RedisRefused,
    rx.OutOfMemoryError,
    rx.ReadOnlyError,
    rx.TryAgainError,
    rx.ClusterDownError,  # MasterDownError is one
)

# Postgres unreachable, restarting, or every pooled connection busy for the pool's timeout.
DATABASE: tuple[type[BaseException], ...] = (
    sx.OperationalError,
    sx.InterfaceError,
    sx.DisconnectionError,
    sx.TimeoutError,  # the pool's checkout timeout
    psycopg.OperationalError,
    psycopg.InterfaceError,
)

# For `except TRANSIENT:`. `is_transient` is the whole definition; the tuple misses only the rare
# cases it lists.
TRANSIENT: tuple[type[BaseException], ...] = (*REDIS, *DATABASE)

_PIPELINE = " of pipeline caused error: "  # redis-py's annotation of a pipeline's failed command


def refusal_code(exc: BaseException) -> str | None:
    """The reply code of a Redis error (`OOM`, `WRONGTYPE`, ...), where it has one."""
    if not isinstance(exc, rx.RedisError):
        return None
    code = getattr(exc, "status_code", None)  # redis-py 6+: set for the codes it maps to a class
    if code:
        return str(code)
    text = str(exc.args[0]) if exc.args else ""
    if _PIPELINE in text:
        text = text.split(_PIPELINE, 1)[1]
    word = text.split(" ", 1)[0]
    return word if word.isupper() else None


def is_transient(exc: BaseException) -> bool:
    """Postgres or Redis unavailable for now: wait and retry (a 503 at the API), never fail a job."""
    if isinstance(exc, TRANSIENT):
        return True
    if isinstance(exc, sx.StatementError) and getattr(exc, "connection_invalidated", False):
        return True
    return isinstance(exc, rx.ResponseError) and refusal_code(exc) in REDIS_REFUSALS
