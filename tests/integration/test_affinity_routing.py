"""Prefix affinity's routing on the real Redis (core/infra/broker.py): `route` pushes each request onto
its key's home worker's own queue, spills past a load bound or a key's rate, and `reclaim` hands a gone
worker's messages to the shared queue, oldest first; the dispatcher's look for lost messages sees
those waiting in a worker's own queue."""

from __future__ import annotations

import asyncio
import base64
import collections
import json

import pytest

from core.infra import broker
from core.jobs import affinity
from tests.conftest import IT_REDIS

MODEL = "affinity-test"
FLEET = [("wa", 12), ("wb", 12), ("wc", 12)]


@pytest.fixture
def clean(rds):
    for key in rds.keys("spool*affinity*") + rds.keys(f"spool.model.{MODEL}*"):
        rds.delete(key)
    yield rds


def _jobs_in(rds, queue: str) -> list[str]:
    """Job ids of the run_job messages in `queue`, oldest (the next taken) first."""
    raw = rds.lrange(queue, 0, -1)
    return [json.loads(base64.b64decode(json.loads(m)["body"]))[0][0] for m in reversed(raw)]


def _message(job_id: str) -> str:
    return broker.task_message(broker.RUN_JOB, [job_id, 1], broker.queue_for(MODEL))


def test_a_key_goes_to_its_home_and_keys_spread(clean):
    rds = clean
    keys = [affinity.from_tokens(1, [i]) for i in range(30)]
    picked = broker.route(rds, MODEL, FLEET, [(_message(f"j{i}"), k) for i, k in enumerate(keys)], 0.5, 8)
    names = [name for name, _ in FLEET]
    for (worker, how), key in zip(picked, keys, strict=True):
        # Each under its bound (30 messages over 3 workers of 12 slots: never over max(ceil(1.5*31/3), 6)).
        assert (worker, how) == (broker.ranked(key, names)[0], "home")
    assert len({w for w, _ in picked}) == 3
    for name in names:
        want = [f"j{i}" for i, (w, _) in enumerate(picked) if w == name]
        assert _jobs_in(rds, broker.direct_queue(MODEL, name)) == want
    # The same key again: the same worker (its cache).
    again = broker.route(rds, MODEL, FLEET, [(_message("again"), keys[0])], 0.5, 8)
    assert again[0][0] == picked[0][0]


def test_a_loaded_home_spills_to_the_next_worker_in_order(clean):
    rds = clean
    key = affinity.from_cache_key(1, "session-1")
    home, second, _ = broker.ranked(key, [n for n, _ in FLEET])
    rds.hset(broker.worker_load(MODEL), home, 20)  # its attempts in hand: far past 1.5x the mean and 6
    picked = broker.route(rds, MODEL, FLEET, [(_message("j1"), key)], 0.5, 8)
    assert picked == [(second, "spilled_load")]
    rds.hset(broker.worker_load(MODEL), home, 1)  # back under the bound: home again
    assert broker.route(rds, MODEL, FLEET, [(_message("j2"), key)], 0.5, 8) == [(home, "home")]


def test_a_hot_key_spills_past_its_rate_in_its_own_order(clean):
    rds = clean
    key = affinity.from_cache_key(1, "everyone-shares-this")
    order = broker.ranked(key, [n for n, _ in FLEET])
    picked = broker.route(rds, MODEL, FLEET, [(_message(f"j{i}"), key) for i in range(12)], 5.0, 4)
    # The first 4 of the second go home, the next 4 to its second worker, the next 4 to its third.
    assert [w for w, _ in picked] == [order[0]] * 4 + [order[1]] * 4 + [order[2]] * 4
    assert collections.Counter(h for _, h in picked) == {"home": 4, "spilled_rate": 8}


def test_a_gone_workers_messages_go_to_the_shared_queue_oldest_first(clean):
    rds = clean
    for name, _ in FLEET:
        broker.announce(rds, MODEL, name, 0)
    for i in range(3):
        rds.lpush(broker.direct_queue(MODEL, "wa"), _message(f"a{i}"))
    rds.lpush(broker.direct_queue(MODEL, "wb"), _message("b0"))
    rds.lpush(broker.queue_for(MODEL), _message("s0"))
    # Every waiting message is seen where it waits (the dispatcher re-sends only lost ones).
    assert {j for j, _ in broker.queued_jobs(rds, MODEL)} == {"a0", "a1", "a2", "b0", "s0"}
    assert broker.reclaim(rds, MODEL, live={"wb", "wc"}) == 3
    assert rds.llen(broker.direct_queue(MODEL, "wa")) == 0
    # The gone worker's messages are taken before what was queued after them, in their own order.
    assert _jobs_in(rds, broker.queue_for(MODEL)) == ["a0", "a1", "a2", "s0"]
    assert _jobs_in(rds, broker.direct_queue(MODEL, "wb")) == ["b0"]  # a live worker's: untouched
    members = {m.decode() for m in rds.smembers(broker.direct_set(MODEL))}
    assert broker.direct_queue(MODEL, "wa") not in members
    # A drained worker hands over its own queue itself.
    assert broker.release(rds, MODEL, "wb") == 1
    assert _jobs_in(rds, broker.queue_for(MODEL))[0] == "b0"  # next to be taken: it waited longest


def test_the_api_sender_routes_and_counts(clean):
    rds = clean
    sender = broker.AsyncSender(IT_REDIS, per_message=8)
    key = affinity.from_cache_key(3, "k")
    home = broker.ranked(key, [n for n, _ in FLEET])[0]

    async def push() -> None:
        try:
            await sender([("r1", 1, MODEL, "interactive", key), ("r2", 1, MODEL, "interactive", None)], {MODEL: FLEET})
        finally:
            await sender.aclose()

    asyncio.run(push())
    assert _jobs_in(rds, broker.direct_queue(MODEL, home)) == ["r1"]
    assert _jobs_in(rds, broker.queue_for(MODEL)) == ["r2"]


def test_a_draining_worker_has_no_slots_and_no_queue_of_its_own(clean):
    from core.jobs import live_workers

    rds = clean
    live_workers.beat(rds, MODEL, "wa", batch_slots=8, interactive_slots=4)
    live_workers.beat(rds, MODEL, "wb", batch_slots=8, interactive_slots=4, draining=True)
    try:
        live = live_workers.live(rds, MODEL)
        assert {w.name for w in live} == {"wa", "wb"}  # still heard: its running jobs are not a cut worker's
        assert live_workers.slots(live) == 12
        assert live_workers.fleet(live) == [("wa", 12)]
    finally:
        live_workers.gone(rds, MODEL, "wa")
        live_workers.gone(rds, MODEL, "wb")


def test_the_dispatcher_moves_a_gone_workers_messages_and_routes_to_the_live(clean, it_settings):
    """The dispatcher's upkeep (`_reclaim`) and its sends (`_send`, for re-queued and contended jobs):
    a worker whose heartbeat is gone loses its queue's messages to the shared queue; a job the
    dispatcher sends goes to a live worker's own queue by its key, never to the gone one's."""
    from core.dispatcher import Dispatcher
    from core.jobs import live_workers

    rds = clean
    d = Dispatcher(None, rds, rds, it_settings.model_copy(update={"models": MODEL}))  # type: ignore[arg-type]
    for name in ("wa", "wb", "wc"):
        live_workers.beat(rds, MODEL, name, batch_slots=8, interactive_slots=4)
        broker.announce(rds, MODEL, name, 0)
    try:
        rds.lpush(broker.direct_queue(MODEL, "wa"), _message("a0"))
        assert d._reclaim() == 0  # all live: nothing moves
        live_workers.gone(rds, MODEL, "wa")
        assert d._reclaim() == 1
        assert _jobs_in(rds, broker.queue_for(MODEL)) == ["a0"]
        # A job whose key's home was wa goes to its next live worker's own queue; with one worker
        # live, a job goes to the shared queue (nothing to choose between).
        keys = (affinity.from_tokens(1, [i]) for i in range(100))
        key = next(k for k in keys if broker.ranked(k, ["wa", "wb", "wc"])[0] == "wa")
        assert d._send(None, [("r1", 1, MODEL, "interactive", key)]) == 1  # type: ignore[arg-type]
        nxt = broker.ranked(key, ["wb", "wc"])[0]
        assert _jobs_in(rds, broker.direct_queue(MODEL, nxt)) == ["r1"]
        live_workers.gone(rds, MODEL, "wc")
        assert d._send(None, [("r2", 1, MODEL, "interactive", key)]) == 1  # type: ignore[arg-type]
        assert _jobs_in(rds, broker.queue_for(MODEL)) == ["a0", "r2"]
    finally:
        for name in ("wa", "wb", "wc"):
            live_workers.gone(rds, MODEL, name)
