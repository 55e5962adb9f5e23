"""Celery task bodies: thin entrypoints over workers/runner.py."""

from __future__ import annotations

from core.batches import webhooks
from core.config import get_settings
from core.infra.broker import DELIVER_WEBHOOK, RUN_JOB, celery_app
from workers.runtime import runner

app = celery_app()


@app.task(name=RUN_JOB)
def run_job(job_id: str, attempt: int) -> str:
    return runner().run(job_id, attempt)


@app.task(name=DELIVER_WEBHOOK)
def deliver_webhook(batch_id: str, body: str) -> str:
    return webhooks.deliver(runner().sessions, batch_id, body, get_settings())
