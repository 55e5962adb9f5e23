"""A host that vanishes while it holds a transaction (issue 39): its link goes down and its process
freezes, so Postgres gets no FIN or RST and, by TCP alone, would keep the session (and its locks)
until keepalive gives up, about two hours by default. Spool's connections tell Postgres to end a
session idle inside a transaction after SPOOL_DB_IDLE_TRANSACTION_S (`core/infra/db.connect_args`):
the lock is free again within that bound, shown here with a real dead peer.

A worker host that vanishes while its consumer is blocked reading the queue: Redis keeps the
connection until its `tcp-keepalive` finds the peer dead, and a message pushed meanwhile goes to the
dead connection (then waits for the dispatcher's re-send). docker-compose.yml's Redis sets it to 10 s
(Redis's default is 300): the dead consumer is dropped within ~20 s, and a message pushed after that
waits for a live one.

The "host" is a network namespace of this test's own, joined to the root namespace by a veth pair
on a private /30; Postgres and Redis are servers of the test's own listening on that link. Needs
root (CI is).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis as redis_lib

from core.config import Settings
from core.infra.db import connect_args
from ops.faults import OwnPostgres
from ops.harness import free_port, wait_for

pytestmark = [
    # wallclock: the dead host's keepalives and idle bounds run out on the clock (25 s of wall, 2 s of CPU in a shard)
    # ops/test.sh runs it beside the CPU-bound shards.
    pytest.mark.wallclock,
    pytest.mark.skipif(
        os.geteuid() != 0
        or shutil.which("ip") is None
        or shutil.which("redis-server") is None
        or not list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        or shutil.which("runuser") is None,
        reason="needs root, iproute2, redis-server and PostgreSQL's server binaries",
    ),
]

ROOT_IP, HOST_IP = "10.213.7.1", "10.213.7.2"
IDLE_S = 4.0  # SPOOL_DB_IDLE_TRANSACTION_S for the dead host's connection


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def host() -> Iterator[tuple[str, str]]:
    """A namespace ("a host") with a veth link to the root namespace; removed even on failure."""
    tag = uuid.uuid4().hex[:6]
    ns, outer, inner = f"spool-dead-{tag}", f"vsd{tag}a", f"vsd{tag}b"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("addr", "add", f"{ROOT_IP}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{HOST_IP}/30", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, outer
    finally:
        subprocess.run(["ip", "link", "del", outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def pg(tmp_path) -> Iterator[OwnPostgres]:
    server = OwnPostgres(tmp_path)
    server.listen = f"127.0.0.1,{ROOT_IP}"
    server.trusted = [f"{HOST_IP}/32"]  # the other host may log in
    server.init()
    try:
        yield server
    finally:
        server.stop("immediate")
        server.remove()


HOLDER = """
import sys, time, psycopg
dsn, args = sys.argv[1], eval(sys.argv[2])
conn = psycopg.connect(dsn, **args)
conn.execute("SELECT id FROM locks WHERE id = 1 FOR UPDATE")  # a transaction opens, and holds the row
print("held", flush=True)
time.sleep(3600)
"""


def test_a_vanished_hosts_transaction_and_lock_are_gone_within_the_idle_bound(host, pg):
    ns, link = host
    with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres", autocommit=True) as admin:
        admin.execute("CREATE TABLE locks (id int PRIMARY KEY)")
        admin.execute("INSERT INTO locks VALUES (1)")
    args = connect_args(Settings(db_idle_transaction_s=IDLE_S), api=True)  # what Spool's API connects with
    dsn = f"host={ROOT_IP} port={pg.port} user=postgres dbname=postgres"
    holder = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", HOLDER, dsn, repr(args)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # The host vanishes: its link down, its processes frozen. Nothing reaches Postgres from it.
        _ip("link", "set", link, "down")
        os.kill(holder.pid, signal.SIGSTOP)
        started = time.monotonic()
        with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres") as other:
            other.execute("SELECT id FROM locks WHERE id = 1 FOR UPDATE")  # waits for the dead host's lock
            waited = time.monotonic() - started
        # Its session is gone, not only its lock. The backend gives up its locks as it aborts, a moment
        # before it leaves pg_stat_activity on exit (a fresh-clone run read it between the two), so the
        # check polls briefly, each read in a transaction (and a stats snapshot) of its own.
        with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres", autocommit=True) as other:
            wait_for(
                lambda: (
                    other.execute("SELECT count(*) FROM pg_stat_activity WHERE client_addr = %s", (HOST_IP,)).fetchone()
                    == (0,)
                ),
                2.0,
                "the dead host's session to leave pg_stat_activity after its lock",
                interval=0.05,
            )
        # It waited for the dead host's lock, and no longer than the idle bound (plus a check's slack)
        assert IDLE_S - 1.0 <= waited <= IDLE_S + 6.0, waited
        log = (pg.data / "log").read_text()
        assert "idle-in-transaction timeout" in log  # ended by the bound, not by anything else
    finally:
        holder.kill()
        holder.wait(10)


def _compose_tcp_keepalive() -> int:
    """The `--tcp-keepalive` that docker-compose.yml gives Redis: the test runs with the shipped value."""
    import yaml

    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
    cmd = [str(c) for c in compose["services"]["redis"]["command"]]
    return int(cmd[cmd.index("--tcp-keepalive") + 1])


CONSUMER = """
import sys, redis
r = redis.Redis(host=sys.argv[1], port=int(sys.argv[2]))
r.client_setname("dead-worker")
print("waiting", flush=True)
print(r.brpop("celery-like-queue", 0), flush=True)  # what a Celery worker's consumer blocks on
"""


def test_a_vanished_worker_hosts_blocked_read_is_dropped_and_takes_no_new_message(host, tmp_path):
    ns, link = host
    keepalive = _compose_tcp_keepalive()
    port = free_port()
    server = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", f"127.0.0.1 {ROOT_IP}", "--protected-mode", "no"),
            *("--save", "", "--appendonly", "no", "--tcp-keepalive", str(keepalive)),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
    )
    admin = redis_lib.Redis(port=port, decode_responses=True)
    consumer = None
    try:
        wait_for(lambda: _pings(admin), 10, "redis")
        consumer = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", CONSUMER, ROOT_IP, str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert consumer.stdout is not None and consumer.stdout.readline().strip() == "waiting"
        wait_for(lambda: _blocked(admin) == 1, 10, "the consumer's BRPOP")
        _ip("link", "set", link, "down")  # the worker host vanishes
        os.kill(consumer.pid, signal.SIGSTOP)
        started = time.monotonic()
        wait_for(lambda: not _blocked(admin), 2 * keepalive + 10, "Redis to drop the dead consumer")
        dropped = time.monotonic() - started
        assert dropped <= 2 * keepalive + 5, dropped  # idle, then 3 probes a third of it apart
        admin.lpush("celery-like-queue", "job message")  # a message sent now waits for a live consumer
        assert admin.llen("celery-like-queue") == 1
        assert admin.brpop(["celery-like-queue"], 5) == ("celery-like-queue", "job message")
    finally:
        if consumer is not None:
            consumer.kill()
            consumer.wait(10)
        admin.close()
        server.kill()
        server.wait(10)


def _pings(r: redis_lib.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis_lib.ConnectionError:
        return False


def _blocked(r: redis_lib.Redis) -> int:
    return sum(1 for c in r.client_list() if c.get("name") == "dead-worker" and c.get("cmd") == "brpop")
