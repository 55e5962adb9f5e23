"""Which workers are alive for a model, and how much batch work they can take.

Each worker process writes a heartbeat into a Redis hash per model every few seconds. The
dispatcher sends batch lines only for free batch slots (the sum over live workers minus the batch
lines already dispatched or running), so bulk work waits in Postgres, in fair order, rather than in
worker threads or Redis; the API and /health read the same hash to know whether a model is served.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from core.infra import redis_keys

HEARTBEAT_S = 2.0
LIVE_S = 10.0  # a worker silent this long is taken for gone
FAILED_S = 600.0  # a worker's start failure is shown this long


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    batch_slots: int
    interactive_slots: int
    seen: float  # unix time of its last heartbeat
    draining: bool = False  # shutting down: finishing what it runs, taking nothing new


def beat(rds: Any, model: str, name: str, batch_slots: int, interactive_slots: int, draining: bool = False) -> None:
    """A worker's heartbeat. A draining one (SIGTERM: it finishes its running jobs) still beats, so its
    jobs are not taken for a cut worker's, but it has no slots and no queue of its own any more."""
    body = json.dumps(
        {"batch_slots": batch_slots, "interactive_slots": interactive_slots, "t": time.time(), "draining": draining}
    )
    pipe = rds.pipeline(transaction=False)
    pipe.hset(redis_keys.live_workers(model), name, body)
    pipe.expire(redis_keys.live_workers(model), int(LIVE_S * 6))
    pipe.execute()


def gone(rds: Any, model: str, name: str) -> None:
    rds.hdel(redis_keys.live_workers(model), name)


def failed(rds: Any, model: str, name: str, error: str) -> None:
    """A worker that could not start (its model did not load, or its warm-up generation failed) leaves
    its reason in the model's worker hash, where /ready and the status page read it; it never counts
    as live. Gone with the hash's expiry once no worker beats for the model (FAILED_S)."""
    body = json.dumps({"error": error[:2000], "t": time.time()})
    pipe = rds.pipeline(transaction=False)
    pipe.hset(redis_keys.live_workers(model), name, body)
    pipe.expire(redis_keys.live_workers(model), int(FAILED_S))
    pipe.execute()


@dataclass(frozen=True)
class WorkerFailure:
    name: str
    error: str
    at: float  # unix time


def _parse(name: Any, raw: Any) -> WorkerInfo | WorkerFailure:
    d = json.loads(raw)
    n = name if isinstance(name, str) else name.decode()
    if "error" in d:
        return WorkerFailure(n, str(d["error"]), float(d["t"]))
    return WorkerInfo(
        n, int(d["batch_slots"]), int(d.get("interactive_slots", 0)), float(d["t"]), bool(d.get("draining"))
    )


def _live(raw: dict, now: float) -> list[WorkerInfo]:
    out = [_parse(n, body) for n, body in raw.items()]
    return [w for w in out if isinstance(w, WorkerInfo) and now - w.seen <= LIVE_S]


def _failures(raw: dict, now: float) -> list[WorkerFailure]:
    out = [_parse(n, body) for n, body in raw.items()]
    return sorted((w for w in out if isinstance(w, WorkerFailure) and now - w.at <= FAILED_S), key=lambda w: -w.at)


def live(rds: Any, model: str, now: float | None = None) -> list[WorkerInfo]:
    return _live(rds.hgetall(redis_keys.live_workers(model)), time.time() if now is None else now)


async def live_async(rds: Any, model: str) -> list[WorkerInfo]:
    return _live(await rds.hgetall(redis_keys.live_workers(model)), time.time())


def failures(rds: Any, model: str, now: float | None = None) -> list[WorkerFailure]:
    """Workers of this model that could not start lately, newest first (their own words)."""
    return _failures(rds.hgetall(redis_keys.live_workers(model)), time.time() if now is None else now)


async def failures_async(rds: Any, model: str) -> list[WorkerFailure]:
    return _failures(await rds.hgetall(redis_keys.live_workers(model)), time.time())


def beats(rds: Any, model: str) -> dict[str, float]:
    """Every started worker's last heartbeat time, as it wrote it (by its own clock): to be compared
    only with an earlier reading of the same worker (core/dispatcher.py), never with another clock."""
    out = (_parse(n, body) for n, body in rds.hgetall(redis_keys.live_workers(model)).items())
    return {w.name: w.seen for w in out if isinstance(w, WorkerInfo)}


def slots(live: list[WorkerInfo]) -> int:
    """The sequences these workers' engines hold at once (batch slots with their prefetch, and the
    interactive ones): how many API requests may be in flight before new ones wait for the dispatcher.
    The prefetch is the margin that keeps an engine full across a dispatch round trip."""
    return sum(w.batch_slots + w.interactive_slots for w in live if not w.draining)


def fleet(live: list[WorkerInfo]) -> list[tuple[str, int]]:
    """The workers prefix affinity may send requests to (core/infra/broker.py `route`): (name, slots) of
    each live one that is not draining."""
    return [(w.name, w.batch_slots + w.interactive_slots) for w in live if not w.draining]


def wake_dispatcher(rds: Any) -> None:
    """Work to hand out now, not at the dispatcher's next tick: a job ended (its slot is free), a
    batch's lines were just queued (validated), or a request was stored `queued` (its model contended).
    Wakes that pile up are one wake."""
    pipe = rds.pipeline(transaction=False)
    pipe.lpush(redis_keys.DISPATCHER_WAKE, 1)
    pipe.ltrim(redis_keys.DISPATCHER_WAKE, 0, 0)
    pipe.execute()


async def wake_dispatcher_async(rds: Any) -> None:
    """`wake_dispatcher` on an asyncio client (the API's)."""
    pipe = rds.pipeline(transaction=False)
    pipe.lpush(redis_keys.DISPATCHER_WAKE, 1)
    pipe.ltrim(redis_keys.DISPATCHER_WAKE, 0, 0)
    await pipe.execute()
