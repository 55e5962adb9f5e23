"""The one definition of "Postgres or Redis unavailable" (core/infra/transient.py), on the exceptions
redis-py, SQLAlchemy and psycopg really raise: Redis's error replies go through redis-py's own parser,
as they do off the wire, so each arrives as the class redis-py (or our registration) gives it."""

from __future__ import annotations

import psycopg
import pytest
from redis import exceptions as rx
from redis._parsers import _RESP2Parser
from sqlalchemy import exc as sx

from core.infra import transient
from core.infra.transient import TRANSIENT, is_transient
from workers import retry

# Error replies as Redis 7 sends them (src/server.c, the `shared.*err` replies), without the leading "-".
REFUSALS = {
    "MISCONF": (
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk. "
        "Commands that may modify the data set are disabled, because this instance is configured to report "
        "errors during writes if RDB snapshotting fails (stop-writes-on-bgsave-error option). Please check "
        "the Redis logs for details about the RDB error."
    ),
    "OOM": "OOM command not allowed when used memory > 'maxmemory'.",
    "READONLY": "READONLY You can't write against a read only replica.",
    "LOADING": "LOADING Redis is loading the dataset in memory",
    "BUSY": "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "NOREPLICAS": "NOREPLICAS Not enough good replicas to write.",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN": "CLUSTERDOWN The cluster is down",
}
# Replies that mean a bug of ours (or a request Redis can never serve): errors, not waits.
BUGS = [
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "ERR Error running script (call to f_0123): @user_script:1: Script attempted to access nonexistent global 'x'",
    "ERR wrong number of arguments for 'get' command",
    "NOSCRIPT No matching script. Please use EVAL.",
    "BUSYKEY Target key name already exists.",
    "EXECABORT Transaction discarded because of previous errors.",
    "ERR value is not an integer or out of range",
]


def parsed(reply: str) -> BaseException:
    """The exception redis-py raises for this error reply."""
    return _RESP2Parser(socket_read_size=65536).parse_error(reply)


@pytest.mark.parametrize("code", sorted(REFUSALS))
def test_a_redis_refusal_is_transient_and_caught_by_the_tuple(code):
    exc = parsed(REFUSALS[code])
    assert isinstance(exc, rx.ResponseError | rx.ConnectionError)  # LOADING: BusyLoadingError, a ConnectionError
    assert is_transient(exc)
    # `except TRANSIENT:` (and Redis's own set, and the workers' letting go) catches it too, not only the predicate
    assert isinstance(exc, TRANSIENT) and isinstance(exc, transient.REDIS) and isinstance(exc, retry.LETTING_GO)


def test_the_classes_redis_py_gives_them():
    assert type(parsed(REFUSALS["READONLY"])) is rx.ReadOnlyError
    assert isinstance(parsed(REFUSALS["LOADING"]), rx.BusyLoadingError)
    assert isinstance(parsed(REFUSALS["OOM"]), rx.OutOfMemoryError | transient.RedisRefused)
    # redis-py has no class for these: a plain ResponseError without our registration
    for code in ("MISCONF", "BUSY", "NOREPLICAS"):
        exc = parsed(REFUSALS[code])
        assert isinstance(exc, transient.RedisRefused) and isinstance(exc, rx.ResponseError), code


@pytest.mark.parametrize("reply", BUGS)
def test_any_other_reply_error_stays_an_error(reply):
    exc = parsed(reply)
    assert isinstance(exc, rx.ResponseError)
    assert not is_transient(exc) and not isinstance(exc, TRANSIENT)


@pytest.mark.parametrize("code", sorted(REFUSALS))
def test_a_refusal_that_reached_us_as_a_plain_response_error(code):
    """Raised by a client built before the registration, or annotated by a pipeline: still its code."""
    assert is_transient(rx.ResponseError(REFUSALS[code]))
    assert is_transient(rx.ResponseError(f"Command # 2 (SET k v) of pipeline caused error: {REFUSALS[code]}"))


def test_a_plain_response_error_naming_a_bug_stays_an_error():
    assert not is_transient(rx.ResponseError(f"Command # 1 (GET k) of pipeline caused error: {BUGS[0]}"))
    assert not is_transient(rx.ResponseError("oom in lowercase is not a reply code"))
    assert not is_transient(rx.DataError("Invalid input of type: 'dict'"))


def test_redis_unreachable():
    for exc in (
        rx.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        rx.TimeoutError("Timeout reading from socket"),
        ConnectionRefusedError(111, "Connection refused"),
        parsed("ERR max number of clients reached"),  # redis-py: a ConnectionError
    ):
        assert is_transient(exc), exc


def _wrapped(cls: type[sx.DBAPIError], orig: Exception, **kw) -> sx.DBAPIError:
    return cls("SELECT 1", {}, orig, **kw)


def test_postgres_unavailable():
    for exc in (
        _wrapped(sx.OperationalError, psycopg.OperationalError("connection failed: Connection refused")),
        _wrapped(sx.InterfaceError, psycopg.InterfaceError("the connection is closed")),
        sx.DisconnectionError("connection lost while idle"),
        sx.TimeoutError("QueuePool limit of size 20 overflow 40 reached, connection timed out, timeout 10.00"),
        psycopg.OperationalError("the server closed the connection unexpectedly"),
        # any statement error on a connection the pool found dead
        _wrapped(sx.ProgrammingError, psycopg.ProgrammingError("?"), connection_invalidated=True),
    ):
        assert is_transient(exc), exc


def test_postgres_errors_that_are_ours():
    for exc in (
        _wrapped(sx.IntegrityError, psycopg.IntegrityError("duplicate key value violates unique constraint")),
        _wrapped(sx.DataError, psycopg.DataError("invalid byte sequence for encoding")),
        _wrapped(sx.ProgrammingError, psycopg.ProgrammingError('relation "jobs" does not exist')),
        ValueError("not ours to wait out"),
        RuntimeError("a bug"),
    ):
        assert not is_transient(exc), exc


def test_reply_codes():
    assert transient.refusal_code(parsed(REFUSALS["MISCONF"])) == "MISCONF"
    assert transient.refusal_code(parsed(BUGS[0])) == "WRONGTYPE"
    assert transient.refusal_code(ValueError("OOM")) is None


def test_the_celery_consumer_waits_out_a_refused_read():
    """MISCONF and READONLY refuse the consumer's BRPOP (a write command): kombu calls a reply error a
    channel error, which Celery retries like a lost connection only when told to."""
    from core.infra.broker import celery_app

    assert celery_app().conf.broker_channel_error_retry is True
