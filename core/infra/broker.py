"""The Celery app both sides share. The API and the dispatcher only *send* tasks by name; the
worker process (workers/) registers the task body on this same app."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from celery import Celery

from core.config import get_settings
from core.infra import kv
from core.infra.metrics import AFFINITY

RUN_JOB = "spool.run_job"
RUN_JOBS = "spool.run_jobs"  # several jobs of one queue in one message: one claim, one Celery round trip
DELIVER_WEBHOOK = "spool.deliver_webhook"
WEBHOOK_QUEUE = "spool.webhooks"  # every worker consumes it after its model's queues


KINDS = ("interactive", "batch")


def queue_for(model: str, kind: str = "interactive") -> str:
    """Two Celery queues per model (a worker consumes only what it has loaded): interactive first."""
    return f"spool.model.{model}.{kind}"


def queues_for(model: str) -> list[str]:
    return [queue_for(model, k) for k in KINDS]


def direct_queue(model: str, worker: str) -> str:
    """One worker's own queue for a model (prefix affinity, core/jobs/affinity.py): consumed by that
    worker before the model's shared ones, emptied into the shared interactive queue once the worker
    is gone (`reclaim`)."""
    return f"spool.model.{model}.w.{worker}"


def direct_set(model: str) -> str:
    """A set of the model's direct queues that may hold messages (each worker adds its own at every
    heartbeat), in the broker's Redis: where the dispatcher looks for a gone worker's messages."""
    return f"spool:affinity:queues:{model}"


def worker_load(model: str) -> str:
    """A hash in the broker's Redis, one field per worker: the attempts it runs now (kept by the worker
    at each start and end). With its direct queue's length, a worker's load for `route`."""
    return f"spool:affinity:load:{model}"


def key_rate(model: str, key: int) -> str:
    """Requests of one affinity key in the current second (`route`'s per-key rate)."""
    return f"spool:affinity:rate:{model}:{key}"


@lru_cache
def celery_app() -> Celery:
    s = get_settings()
    app = Celery("spool", broker=s.celery_broker_url)
    app.conf.update(
        # Early acks (Celery's default) plus no prefetch: Redis emulates acks with a visibility
        # timeout from delivery, so a late-acked generation longer than it would be redelivered and
        # run again. Postgres is the ledger; a lost message only costs the dispatcher's re-send.
        task_acks_late=False,
        worker_disable_prefetch=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue="spool.default",
        broker_connection_retry_on_startup=True,
        # A Redis that refuses the consumer's BRPOP for now (MISCONF: it cannot persist; READONLY: a
        # failover made it a replica) answers a reply error, which kombu counts as a channel error:
        # without this the worker's consumer stopped for good; with it, it reconnects with the same
        # backoff as after a lost connection (an outage, never a failure, as core/infra/transient.py says).
        broker_channel_error_retry=True,
        worker_hijack_root_logger=False,
        # "priority": a worker always takes from its first queue (interactive) before the next (batch);
        # kombu's default round-robin would alternate between them.
        # No ack emulation: with early acks it only kept a copy of each message in an "unacked" hash
        # for the instant between delivery and ack, at two Redis round trips and a new client object
        # per message (a fifth of a worker's CPU on short jobs). A message lost with a killed worker
        # is re-sent by the dispatcher, as it was before (the hash's visibility timeout is an hour).
        broker_transport_options={"ack_emulation": False, "queue_order_strategy": "priority", **kv.KEEPALIVE},
        worker_send_task_events=False,
    )
    return app


# Celery's task message (protocol 2) as kombu's Redis transport keeps it: a JSON envelope whose
# base64 body is [args, kwargs, embed], pushed onto the queue's list (priority 0: the list named as
# the queue). Written here instead of through `send_task`, which cost ~0.5 ms of CPU per job (message
# building, producer pool, exchange lookup) plus its own Redis round trips; the worker consumes it
# through Celery unchanged. tests/integration/test_broker_message.py holds it to what send_task writes
# and to what kombu's Redis transport and Celery's worker request decode from it.
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_ORIGIN = f"spool@{socket.gethostname()}:{os.getpid()}"


def task_message(task: str, args: list[Any], queue: str) -> str:
    tid = str(uuid.uuid4())
    body = base64.b64encode(json.dumps([args, {}, _EMBED]).encode()).decode()
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task,
        "id": tid,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": tid,
        "parent_id": None,
        "argsrepr": repr(args),
        "kwargsrepr": "{}",
        "origin": _ORIGIN,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    properties = {
        "correlation_id": tid,
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    return json.dumps(
        {
            "body": body,
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": properties,
        }
    )


@lru_cache
def _broker() -> Any:
    from core.infra import kv

    return kv.client(get_settings().celery_broker_url)


def send(task: str, args: list[Any], queue: str) -> None:
    """One task message onto `queue` (blocking I/O): its far end, behind what already waits there."""
    _broker().lpush(queue, task_message(task, args, queue))


# Picks a worker for each of a model's new requests and pushes its message onto that worker's direct
# queue, in one round trip. KEYS: the load hash, the n candidates' direct queues, then one per-key rate
# counter per message. ARGV: n, m, spill load, key rate, then n slot counts, n worker names, then per
# message its text and its order (candidate indexes, 1-based, home first). A worker's load: its running
# attempts plus the messages waiting in its queue. The message goes to the first worker in its key's
# order, after skipping one place per `rate` requests the key sent this second, whose load is under
# max(ceil((1 + spill) * (total + 1) / n), slots / 2) (bounded-load consistent hashing, Mirrokni et al.
# 2018); none under: the least loaded. Returns per message [worker index, how]: 0 its home, 1 spilled
# for load, 2 spilled for the key's rate.
_ROUTE = kv.Lua(
    """
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local spill, rate = tonumber(ARGV[3]), tonumber(ARGV[4])
local load, slots, total = {}, {}, 0
for i = 1, n do
  slots[i] = tonumber(ARGV[4 + i])
  local held = tonumber(redis.call('HGET', KEYS[1], ARGV[4 + n + i]) or '0') or 0
  if held < 0 then held = 0 end
  load[i] = held + redis.call('LLEN', KEYS[1 + i])
  total = total + load[i]
end
local out = {}
local base = 4 + 2 * n
for j = 1, m do
  local msg, order = ARGV[base + 2 * j - 1], {}
  for idx in string.gmatch(ARGV[base + 2 * j], '%d+') do order[#order + 1] = tonumber(idx) end
  local seen = redis.call('INCR', KEYS[1 + n + j])
  if seen == 1 then redis.call('EXPIRE', KEYS[1 + n + j], 2) end
  local start = math.floor((seen - 1) / rate) % #order
  local bound = math.ceil((1 + spill) * (total + 1) / n)
  local pick, how = nil, (start > 0) and 2 or 1
  for k = 0, #order - 1 do
    local i = order[(start + k) % #order + 1]
    if load[i] < math.max(bound, math.floor(slots[i] / 2)) then pick = i; break end
  end
  if pick == nil then
    for k = 0, #order - 1 do
      local i = order[(start + k) % #order + 1]
      if pick == nil or load[i] < load[pick] then pick = i end
    end
  end
  if pick == order[1] then how = 0 end
  redis.call('LPUSH', KEYS[1 + pick], msg)
  load[pick] = load[pick] + 1
  total = total + 1
  out[#out + 1] = {pick, how}
end
return out
"""
)

# A gone worker's direct queue emptied into the model's shared interactive queue, oldest message first
# to be taken (they waited longest), then forgotten. KEYS: the direct queue, the shared queue, the set.
_RECLAIM = kv.Lua(
    """
local moved = 0
while true do
  local msg = redis.call('LPOP', KEYS[1])
  if not msg then break end
  redis.call('RPUSH', KEYS[2], msg)
  moved = moved + 1
end
redis.call('SREM', KEYS[3], KEYS[1])
return moved
"""
)

ROUTED_HOW = ("home", "spilled_load", "spilled_rate")


def weight(key: int, worker: str) -> int:
    """Rendezvous (highest random weight) hashing, Thaler and Ravishankar 1998: `worker`'s weight for
    `key`. A worker that comes or goes moves only the keys whose first place it takes or held (1/N of
    them); every other key keeps its home, and with it its cached prefixes."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{worker}".encode(), digest_size=8).digest(), "big")


def ranked(key: int, workers: Sequence[str]) -> list[str]:
    """`workers` in `key`'s order: its home first, then where it spills."""
    return sorted(workers, key=lambda w: (-weight(key, w), w))


def _route_args(
    model: str, fleet: Sequence[tuple[str, int]], routed: Sequence[tuple[str, int]], spill: float, rate: int
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of `_ROUTE` for `routed` messages, each (text, affinity key)."""
    names = [name for name, _ in fleet]
    index = {name: i + 1 for i, name in enumerate(names)}
    keys = [worker_load(model), *(direct_queue(model, name) for name in names)]
    args: list[Any] = [len(names), len(routed), spill, rate, *(slots for _, slots in fleet), *names]
    for message, key in routed:
        keys.append(key_rate(model, key))
        args += [message, ",".join(str(index[w]) for w in ranked(key, names))]
    return keys, args


def route(
    rds: Any, model: str, fleet: Sequence[tuple[str, int]], routed: Sequence[tuple[str, int]], spill: float, rate: int
) -> list[tuple[str, str]]:
    """Push each (message, affinity key) onto the direct queue `_ROUTE` picks among `fleet` (each live
    worker's (name, slots)); returns (worker, how) per message."""
    keys, args = _route_args(model, fleet, routed, spill, rate)
    return [(fleet[int(i) - 1][0], ROUTED_HOW[int(h)]) for i, h in _ROUTE(rds, keys, *args)]


async def route_async(
    rds: Any, model: str, fleet: Sequence[tuple[str, int]], routed: Sequence[tuple[str, int]], spill: float, rate: int
) -> list[tuple[str, str]]:
    keys, args = _route_args(model, fleet, routed, spill, rate)
    return [(fleet[int(i) - 1][0], ROUTED_HOW[int(h)]) for i, h in await _ROUTE.run_async(rds, keys, *args)]


def release(rds: Any, model: str, worker: str) -> int:
    """A worker leaving (its shutdown): its own queue's messages to the shared queue at once."""
    queue = direct_queue(model, worker)
    return int(_RECLAIM(rds, [queue, queue_for(model), direct_set(model)]))


def announce(rds: Any, model: str, worker: str, load: int | None = None) -> None:
    """A worker's own queue named where `reclaim` looks (every heartbeat, so that one removed while the
    worker was cut from Redis is named again), and its load when given (`route`)."""
    pipe = rds.pipeline(transaction=False)
    pipe.sadd(direct_set(model), direct_queue(model, worker))
    if load is not None:
        pipe.hset(worker_load(model), worker, load)
    pipe.execute()


def set_load(rds: Any, model: str, worker: str, load: int) -> None:
    rds.hset(worker_load(model), worker, load)


def reclaim(rds: Any, model: str, live: set[str]) -> int:
    """Every direct queue of `model` whose worker is not in `live` emptied into the shared interactive
    queue (a worker dead, drained or cut from Redis: its messages go to the others). Returns how many moved."""
    moved = 0
    prefix = direct_queue(model, "")
    for raw in rds.smembers(direct_set(model)):
        queue = raw if isinstance(raw, str) else raw.decode()
        if queue.removeprefix(prefix) in live:
            continue
        moved += int(_RECLAIM(rds, [queue, queue_for(model), direct_set(model)]))
    return moved


def send_run_job(job_id: str, attempt: int, model: str, kind: str = "interactive") -> None:
    """Publish one `run_job(job_id, attempt)` message to the model's queue (blocking I/O)."""
    queue = queue_for(model, kind)
    _broker().lpush(queue, task_message(RUN_JOB, [job_id, attempt], queue))


def run_messages(jobs: Sequence[tuple[str, int, str, str]], per_message: int) -> list[tuple[str, str]]:
    """(queue, message) for new jobs, each (job id, attempt, model, kind): the jobs of one queue split
    evenly into `run_jobs` messages of at most `per_message` (a lone job: `run_job`). A worker claims a
    message's jobs in one statement; smaller messages let several workers share a burst."""
    by_queue: dict[str, list[list[Any]]] = {}
    for job_id, attempt, model, kind in jobs:
        by_queue.setdefault(queue_for(model, kind), []).append([job_id, attempt])
    out = []
    for queue, pairs in by_queue.items():
        parts = -(-len(pairs) // per_message)
        size = -(-len(pairs) // parts)
        for i in range(0, len(pairs), size):
            chunk = pairs[i : i + size]
            args = chunk[0] if len(chunk) == 1 else [chunk]
            out.append((queue, task_message(RUN_JOB if len(chunk) == 1 else RUN_JOBS, args, queue)))
    return out


# A new job for a worker: (job id, attempt, model, kind, affinity key or None).
Outbound = tuple[str, int, str, str, int | None]
# A model's live workers as the sender last saw them: (name, slots) each.
Fleet = Sequence[tuple[str, int]]


def split_routed(jobs: Sequence[Outbound], fleets: Mapping[str, Fleet]) -> tuple[list[Outbound], list[Outbound]]:
    """(routed, shared): API requests with a key, of a model with two live workers or more, go to one
    worker's own queue (`route`); the rest to the model's shared queues, as before affinity."""
    routed: list[Outbound] = []
    shared: list[Outbound] = []
    for job in jobs:
        several = len(fleets.get(job[2]) or ()) > 1
        (routed if several and job[3] == "interactive" and job[4] is not None else shared).append(job)
    return routed, shared


def _routed_by_model(routed: Sequence[Outbound]) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for job_id, attempt, model, _, key in routed:
        assert key is not None
        out.setdefault(model, []).append((task_message(RUN_JOB, [job_id, attempt], queue_for(model)), key))
    return out


class AsyncSender:
    """The API's sender: new jobs' messages (`run_messages`), pushed with an async client (a thread hop
    per request to run the blocking one cost more CPU than the push itself), all of a group of new
    jobs in one pipeline; API requests of a model with several live workers go to the worker their
    affinity key picks (`route`, one script call per model), one message each."""

    def __init__(self, url: str, per_message: int = 8, spill: float = 0.5, rate: int = 8) -> None:
        from core.infra import kv

        self._redis = kv.async_client(url)
        self.per_message, self.spill, self.rate = per_message, spill, rate

    async def __call__(self, jobs: Sequence[Outbound], fleets: Mapping[str, Fleet] | None = None) -> None:
        routed, shared = split_routed(jobs, fleets or {})
        for model, keyed in _routed_by_model(routed).items():
            picked = await route_async(self._redis, model, (fleets or {})[model], keyed, self.spill, self.rate)
            for _, how in picked:
                AFFINITY.labels(model, how).inc()
        messages = run_messages([(j[0], j[1], j[2], j[3]) for j in shared], self.per_message)
        if not messages:
            return
        if len(messages) == 1:
            await self._redis.lpush(*messages[0])
            return
        pipe = self._redis.pipeline(transaction=False)
        for queue, message in messages:
            pipe.lpush(queue, message)
        await pipe.execute()

    async def aclose(self) -> None:
        await self._redis.aclose()


def send_routed(rds: Any, jobs: Sequence[Outbound], fleets: Mapping[str, Fleet], spill: float, rate: int) -> int:
    """The dispatcher's `AsyncSender`: each job onto its worker's own queue where `split_routed` says so,
    else its model's shared one; returns how many went by affinity."""
    routed, shared = split_routed(jobs, fleets)
    for model, messages in _routed_by_model(routed).items():
        for _, how in route(rds, model, fleets[model], messages, spill, rate):
            AFFINITY.labels(model, how).inc()
    for job_id, attempt, model, kind, _ in shared:
        queue = queue_for(model, kind)
        rds.lpush(queue, task_message(RUN_JOB, [job_id, attempt], queue))
    return len(routed)


def send_run_jobs(pairs: list[tuple[str, int]], model: str) -> None:
    """Publish one `run_jobs([[job_id, attempt], ...])` message (batch lines of one model)."""
    send(RUN_JOBS, [[list(p) for p in pairs]], queue_for(model, "batch"))


def on_shutdown(fn: Any) -> None:
    """`fn` called as a worker begins its warm shutdown (SIGTERM: Celery stops consuming, lets running
    tasks end)."""
    from celery.signals import worker_shutting_down

    worker_shutting_down.connect(fn, weak=False)


def send_deliver_webhook(batch_id: str, body: str) -> None:
    celery_app().send_task(DELIVER_WEBHOOK, args=[batch_id, body], queue=WEBHOOK_QUEUE)


def queued_jobs(broker: Any, model: str, limit: int = 10_000) -> set[tuple[str, int]]:
    """(job id, attempt) of every run_job message still waiting in the model's queues, its workers'
    direct ones included. Kombu's Redis transport keeps each message as JSON with a base64 body holding
    Celery's [args, kwargs, embed]."""
    out: set[tuple[str, int]] = set()
    direct = [q if isinstance(q, str) else q.decode() for q in broker.smembers(direct_set(model))]
    for q in [*queues_for(model), *direct]:
        for raw in broker.lrange(q, 0, limit - 1):
            try:
                msg = json.loads(raw)
                args = json.loads(base64.b64decode(msg["body"]))[0]
                pairs = args[0] if isinstance(args[0], list) else [args]  # run_jobs or run_job
                out.update((str(job_id), int(attempt)) for job_id, attempt in pairs)
            except (ValueError, KeyError, IndexError, TypeError):
                continue  # not one of ours
    return out
