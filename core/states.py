"""The ledger's words: a job's states and kinds, how a job ended, a batch's and a file's status, a key's scope.

The bottom layer of core (pyproject.toml's layers contract): it imports nothing of Spool, and every
package may import it. The ORM builds its check constraints and column defaults from these enums,
the pure packages (core/generation, core/protocol) read rows with them, and the domain moves rows
from one to another (core/jobs/transitions.py, core/batches/transitions.py). The column values are these
enums' values; StrEnum members compare equal to them. This is the one home of these words (a job has
a state; a batch and a file have a status): the rest of Spool imports them from here.
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


class Ending(enum.StrEnum):
    """How a job ended: the terminal state it reached, and the outcome its usage is counted under
    (`usage_daily.failed` counts every ending but `succeeded`; the `outcome` label of
    spool_jobs_finished_total). Every way a job ends (core/jobs/lifecycle.py) records one."""

    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"  # a batch line its batch's completion window closed on before it ran

    @property
    def state(self) -> JobState:
        return JobState(self.value)


TERMINAL_STATES = frozenset(e.state for e in Ending)


class JobKind(enum.StrEnum):
    """An API request (sent right after commit when its tenant has room) or a batch line (fed by the
    dispatcher's fair scheduler); each has its own Celery queue per model."""

    interactive = "interactive"
    batch = "batch"


class BatchStatus(enum.StrEnum):
    """OpenAI's words. validating -> in_progress -> finalizing -> completed | expired | cancelled;
    validating -> failed; validating | in_progress -> cancelling -> (finalizing ->) cancelled. Every
    change is one compare-and-set in core/batches/transitions.py."""

    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


FINAL = frozenset({BatchStatus.completed, BatchStatus.failed, BatchStatus.expired, BatchStatus.cancelled})


class FileStatus(enum.StrEnum):
    """A stored file: `processed` once whole (OpenAI's word, the only one a client sees); before that
    hidden like a deleted file, `uploading` while an upload's chunks arrive (core/files/service.Upload)
    or `processing` while the batch keeper writes a batch's result file (core/batches/progress.py)."""

    uploading = "uploading"
    processing = "processing"
    processed = "processed"


class KeyScope(enum.StrEnum):
    """What an API key may call: the tenant's own API (`user`), or /admin, /metrics and /ui too."""

    user = "user"
    admin = "admin"
