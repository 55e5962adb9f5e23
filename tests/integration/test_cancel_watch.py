"""The worker's cancel watch (workers/cancels.py) against a real Redis: one pipelined round trip
tells every watched attempt whose job was cancelled, and a Redis outage flags nothing."""

from __future__ import annotations

import socket

import redis as redis_lib

from core.infra.streams import keys
from tests.integration.conftest import IT_REDIS
from workers.cancels import CancelWatch


def test_one_round_flags_exactly_the_cancelled_jobs(rds):
    watch = CancelWatch(redis_lib.Redis.from_url(IT_REDIS))
    seen: list[str] = []
    callbacks = {j: (lambda j=j: seen.append(j)) for j in ("cw-a", "cw-b", "cw-c")}
    for job_id, cb in callbacks.items():
        watch.watch(job_id, cb)
    watch.check()
    assert seen == [] and watch.rounds == 1

    rds.set(keys.cancel_key("cw-b"), 1, ex=60)
    watch.check()
    assert seen == ["cw-b"] and watch.rounds == 2  # three jobs, one round trip

    # An attempt that ended is no longer asked about; a newer attempt's watch is not undone by an
    # older one's late unwatch.
    watch.unwatch("cw-b", callbacks["cw-b"])
    newer = lambda: seen.append("cw-a again")  # noqa: E731
    watch.watch("cw-a", newer)
    watch.unwatch("cw-a", callbacks["cw-a"])
    rds.set(keys.cancel_key("cw-a"), 1, ex=60)
    watch.check()
    assert seen == ["cw-b", "cw-a again"]


def test_redis_away_flags_nothing_and_the_watch_goes_on(rds):
    with socket.socket() as s:  # a port nothing listens on: connection refused, like Redis down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    watch = CancelWatch(redis_lib.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5))
    seen: list[str] = []
    watch.watch("cw-away", lambda: seen.append("cw-away"))
    watch.check()  # raises nothing: unknown is not cancelled
    assert seen == [] and watch.rounds == 0


def test_the_watch_thread_calls_back_within_its_period(rds):
    import threading

    watch = CancelWatch(redis_lib.Redis.from_url(IT_REDIS), every=0.05)
    hit = threading.Event()
    watch.watch("cw-thread", hit.set)
    rds.set(keys.cancel_key("cw-thread"), 1, ex=60)
    assert hit.wait(10), "the watch thread never saw the cancel"


def test_the_thread_ends_when_nothing_is_watched_and_comes_back_on_the_next_watch(rds):
    """An idle worker (or a test that built a runner) holds no thread asking Redis for nothing."""
    import threading
    import time

    watch = CancelWatch(redis_lib.Redis.from_url(IT_REDIS), every=0.05)
    watch.watch("cw-idle", lambda: None)
    assert watch.running()
    watch.unwatch("cw-idle", watch._watched["cw-idle"])
    deadline = time.monotonic() + 10
    while watch.running():
        assert time.monotonic() < deadline, "the watch thread outlived its last job"
        time.sleep(0.02)

    hit = threading.Event()
    watch.watch("cw-again", hit.set)
    rds.set(keys.cancel_key("cw-again"), 1, ex=60)
    assert hit.wait(10), "a watch after the thread ended was never checked"
