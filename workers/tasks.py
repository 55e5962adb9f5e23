"""Celery task bodies: thin entrypoints over workers/runner.py."""

from __future__ import annotations

import logging

from celery import Task
from celery.signals import worker_ready

from core.batches import webhooks
from core.config import get_settings
from core.infra import broker, heap
from core.infra.broker import DELIVER_WEBHOOK, RUN_JOB, RUN_JOBS, celery_app
from core.infra.transient import TRANSIENT
from workers.outcome import Outcome
from workers.runtime import runner

app = celery_app()
log = logging.getLogger(__name__)


@worker_ready.connect
def _serving(**_: object) -> None:
    """Model loaded, Celery consuming: the startup heap is set aside from full collections (a
    collection walking the engine's and Celery's objects stalled the thread that feeds the engine)."""
    heap.freeze_startup()


@app.task(name=RUN_JOB, bind=True)
def run_job(self: Task, job_id: str, attempt: int) -> Outcome:
    out = runner().run(job_id, attempt)
    if out == Outcome.unclaimed:
        give_back(self.request.delivery_info, RUN_JOB, [job_id, attempt])
    return out


@app.task(name=RUN_JOBS, bind=True)
def run_jobs(self: Task, pairs: list[list]) -> list[Outcome]:
    outs = runner().run_group([(str(job_id), int(attempt)) for job_id, attempt in pairs])
    if outs and all(o == Outcome.unclaimed for o in outs):
        give_back(self.request.delivery_info, RUN_JOBS, [pairs])
    return outs


def give_back(delivery_info: dict | None, task: str, args: list) -> bool:
    """A message this worker took and could not claim, pushed back onto the queue it came from for
    another worker. Without Redis either, nothing is pushed: the dispatcher re-sends it later (and a
    copy that races the re-send is harmless: a claim is a compare-and-set)."""
    queue = (delivery_info or {}).get("routing_key")
    if not queue:
        return False
    try:
        broker.send(task, args, queue)
    except TRANSIENT:
        log.warning("could not give %s %s back to %s (Redis away too); the dispatcher re-sends it", task, args, queue)
        return False
    return True


_WEBHOOKS = webhooks.Pool()


@app.task(name=DELIVER_WEBHOOK)
def deliver_webhook(batch_id: str, body: str) -> str:
    # Handed to the webhook pool at once: a receiver that drips its answer never holds this thread.
    return _WEBHOOKS.submit(runner().sessions, batch_id, body, get_settings())
