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


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    batch_slots: int
    interactive_slots: int
    seen: float  # unix time of its last heartbeat


def beat(rds: Any, model: str, name: str, batch_slots: int, interactive_slots: int) -> None:
    body = json.dumps({"batch_slots": batch_slots, "interactive_slots": interactive_slots, "t": time.time()})
    pipe = rds.pipeline(transaction=False)
    pipe.hset(redis_keys.live_workers(model), name, body)
    pipe.expire(redis_keys.live_workers(model), int(LIVE_S * 6))
    pipe.execute()


def gone(rds: Any, model: str, name: str) -> None:
    rds.hdel(redis_keys.live_workers(model), name)


def _parse(name: Any, raw: Any) -> WorkerInfo:
    d = json.loads(raw)
    n = name if isinstance(name, str) else name.decode()
    return WorkerInfo(n, int(d["batch_slots"]), int(d.get("interactive_slots", 0)), float(d["t"]))


def live(rds: Any, model: str, now: float | None = None) -> list[WorkerInfo]:
    now = time.time() if now is None else now
    out = [_parse(n, raw) for n, raw in rds.hgetall(redis_keys.live_workers(model)).items()]
    return [w for w in out if now - w.seen <= LIVE_S]


async def live_async(rds: Any, model: str) -> list[WorkerInfo]:
    now = time.time()
    out = [_parse(n, raw) for n, raw in (await rds.hgetall(redis_keys.live_workers(model))).items()]
    return [w for w in out if now - w.seen <= LIVE_S]


def batch_capacity(rds: Any, model: str) -> int:
    return sum(w.batch_slots for w in live(rds, model))


def wake_dispatcher(rds: Any) -> None:
    """Batch work to hand out now, not at the dispatcher's next tick: a batch line ended (its slot is
    free) or a batch's lines were just queued (validated). Wakes that pile up are one wake."""
    pipe = rds.pipeline(transaction=False)
    pipe.lpush(redis_keys.DISPATCHER_WAKE, 1)
    pipe.ltrim(redis_keys.DISPATCHER_WAKE, 0, 0)
    pipe.execute()
