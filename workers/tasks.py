"""Celery task bodies: thin entrypoints over workers/runner.py."""

from __future__ import annotations

from celery.signals import worker_ready

from core.batches import webhooks
from core.config import get_settings
from core.infra import heap
from core.infra.broker import DELIVER_WEBHOOK, RUN_JOB, RUN_JOBS, celery_app
from workers.outcome import Outcome
from workers.runtime import runner

app = celery_app()


@worker_ready.connect
def _serving(**_: object) -> None:
    """Model loaded, Celery consuming: the startup heap is set aside from full collections (a
    collection walking the engine's and Celery's objects stalled the thread that feeds the engine)."""
    heap.freeze_startup()


@app.task(name=RUN_JOB)
def run_job(job_id: str, attempt: int) -> Outcome:
    return runner().run(job_id, attempt)


@app.task(name=RUN_JOBS)
def run_jobs(pairs: list[list]) -> list[Outcome]:
    return runner().run_group([(str(job_id), int(attempt)) for job_id, attempt in pairs])


_WEBHOOKS = webhooks.Pool()


@app.task(name=DELIVER_WEBHOOK)
def deliver_webhook(batch_id: str, body: str) -> str:
    # Handed to the webhook pool at once: a receiver that drips its answer never holds this thread.
    return _WEBHOOKS.submit(runner().sessions, batch_id, body, get_settings())
