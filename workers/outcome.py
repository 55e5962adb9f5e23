"""How an attempt ends, typed: the Celery task's return value, and the errors that end a job."""

from __future__ import annotations

from enum import StrEnum

from core.generation.events import ErrorInfo


class Outcome(StrEnum):
    succeeded = "succeeded"
    failed = "failed"  # stored with its error: the engine's verdict, or what the job asked for
    cancelled = "cancelled"  # its client or owner cancelled it; the lifecycle ended it
    lost = "lost"  # another attempt owns it now (lease lapsed, fenced, or cancelled meanwhile)
    abandoned = "abandoned"  # the infrastructure stayed away: its lease lapses and the next attempt resumes
    skipped = "skipped"  # not claimable: a duplicate or stale message
    unclaimed = "unclaimed"  # Postgres away for this worker: its message goes back to the queue for another


class JobError(Exception):
    """A job that cannot succeed because of what it asked for; stored on the job as its error."""

    def __init__(
        self, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.error = ErrorInfo(message=message, type=type_, param=param, code=code)


class EngineError(Exception):
    """The engine gave up on one of the job's sequences (its own verdict, not an outage)."""
