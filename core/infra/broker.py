"""The Celery app both sides share. The API and the dispatcher only *send* tasks by name; the
worker process (workers/) registers the task body on this same app."""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from celery import Celery

from core.config import get_settings
from core.infra import kv

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


class AsyncSender:
    """The API's sender: new jobs' messages (`run_messages`), pushed with an async client (a thread hop
    per request to run the blocking one cost more CPU than the push itself), all of a group of new
    jobs in one pipeline: (job id, attempt, model, kind) each."""

    def __init__(self, url: str, per_message: int = 8) -> None:
        from core.infra import kv

        self._redis = kv.async_client(url)
        self.per_message = per_message

    async def __call__(self, jobs: Sequence[tuple[str, int, str, str]]) -> None:
        messages = run_messages(jobs, self.per_message)
        if len(messages) == 1:
            await self._redis.lpush(*messages[0])
            return
        pipe = self._redis.pipeline(transaction=False)
        for queue, message in messages:
            pipe.lpush(queue, message)
        await pipe.execute()

    async def aclose(self) -> None:
        await self._redis.aclose()


def send_run_jobs(pairs: list[tuple[str, int]], model: str) -> None:
    """Publish one `run_jobs([[job_id, attempt], ...])` message (batch lines of one model)."""
    send(RUN_JOBS, [[list(p) for p in pairs]], queue_for(model, "batch"))


def send_deliver_webhook(batch_id: str, body: str) -> None:
    celery_app().send_task(DELIVER_WEBHOOK, args=[batch_id, body], queue=WEBHOOK_QUEUE)


def queued_jobs(broker: Any, model: str, limit: int = 10_000) -> set[tuple[str, int]]:
    """(job id, attempt) of every run_job message still waiting in the model's queues. Kombu's Redis
    transport keeps each message as JSON with a base64 body holding Celery's [args, kwargs, embed]."""
    out: set[tuple[str, int]] = set()
    for q in queues_for(model):
        for raw in broker.lrange(q, 0, limit - 1):
            try:
                msg = json.loads(raw)
                args = json.loads(base64.b64decode(msg["body"]))[0]
                pairs = args[0] if isinstance(args[0], list) else [args]  # run_jobs or run_job
                out.update((str(job_id), int(attempt)) for job_id, attempt in pairs)
            except (ValueError, KeyError, IndexError, TypeError):
                continue  # not one of ours
    return out
