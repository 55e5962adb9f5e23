"""A job's states and kinds: the domain's words, beside core/batches/status.py's BatchStatus.

Pure (no imports of Spool): core/infra/orm.py builds the `jobs` table's check constraints from
them, the one import of the domain that the adapters make (pyproject.toml's layers contract).
The column values are these enums' values; StrEnum members compare equal to them.
"""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    """queued -> dispatched -> running -> succeeded | failed | cancelled; `expired`: a batch line that
    never ran. Every change is one compare-and-set in core/jobs/transitions.py."""

    queued = "queued"
    dispatched = "dispatched"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"


TERMINAL_STATES = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.expired})


class JobKind(enum.StrEnum):
    """An API request (sent right after commit when its tenant has room) or a batch line (fed by the
    dispatcher's fair scheduler); each has its own Celery queue per model."""

    interactive = "interactive"
    batch = "batch"
