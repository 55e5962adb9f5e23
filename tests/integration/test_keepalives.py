"""Issue 39: a host that vanishes (no FIN, no RST) is found dead by the clients' own TCP keepalives
in seconds, not TCP's two hours. Read off the real sockets Spool's Postgres engine, its Redis clients
and the Celery consumer open against the real servers (the dead-peer behaviour itself is shown with a
vanishing host in tests/e2e/test_dead_host.py and ops/cluster.py)."""

from __future__ import annotations

import socket

from sqlalchemy import create_engine, text

from core.config import Settings
from core.infra import broker, db, kv
from tests.integration.conftest import IT_DB, IT_REDIS


def _keepalive(sock: socket.socket) -> tuple[int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    )


def test_postgres_connections_keep_alive_and_bound_unacknowledged_data(sessions):
    engine = create_engine(IT_DB, connect_args=db.connect_args(Settings()))
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
            raw = conn.connection.dbapi_connection
            sock = socket.socket(fileno=raw.fileno())
            try:
                assert _keepalive(sock) == (1, 10, 5, 3)
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000
            finally:
                sock.detach()  # the connection's socket: not ours to close
    finally:
        engine.dispose()


def test_redis_clients_keep_alive():
    rds = kv.client(IT_REDIS)
    try:
        assert rds.ping()
        conn = rds.connection_pool.get_connection()
        try:
            assert conn._sock is not None
            assert _keepalive(conn._sock) == (1, 10, 5, 3)
        finally:
            rds.connection_pool.release(conn)
    finally:
        rds.close()


def test_the_celery_consumer_keeps_alive(monkeypatch):
    monkeypatch.setenv("SPOOL_REDIS_URL", IT_REDIS)
    from core.config import get_settings

    get_settings.cache_clear()
    broker.celery_app.cache_clear()
    try:
        app = broker.celery_app()
        with app.connection_for_read() as connection:
            client = connection.default_channel.client  # kombu's redis-py client for the consumer
            assert client.ping()
            conn = client.connection_pool.get_connection()
            try:
                assert _keepalive(conn._sock) == (1, 10, 5, 3)
            finally:
                client.connection_pool.release(conn)
    finally:
        broker.celery_app.cache_clear()
        get_settings.cache_clear()
