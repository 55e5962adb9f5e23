"""Celery task bodies: thin entrypoints over workers/runner.py."""

from __future__ import annotations

from core.infra.broker import RUN_JOB, celery_app
from workers.runtime import runner

app = celery_app()


@app.task(name=RUN_JOB)
def run_job(job_id: str, attempt: int) -> str:
    return runner().run(job_id, attempt)
