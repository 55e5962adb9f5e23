"""A batch's status transitions, each one compare-and-set UPDATE: the only writer of `batches.status`, as
core/jobs/transitions.py is of `jobs.state`.

validating -> in_progress -> finalizing -> completed | expired | cancelled; validating -> failed;
validating | in_progress -> cancelling -> (finalizing ->) cancelled. The only writer of `batches.status`
(tests/unit/test_state_writers.py). The statuses themselves (`BatchStatus`, and `FINAL`) are
core/states.py's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Update, update

from core.infra.orm import Batch
from core.states import FINAL, BatchStatus

LIVE = (BatchStatus.in_progress, BatchStatus.cancelling, BatchStatus.finalizing)  # lines may still run
CANCELLABLE = (BatchStatus.validating, BatchStatus.in_progress)
EMPTY_COUNTS = {"total": 0, "completed": 0, "failed": 0}


def _move(batch_id: str, frm: tuple[BatchStatus, ...], to: BatchStatus, **values: Any) -> Update:
    return (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_([s.value for s in frm]))
        .values(status=to.value, **values)
    )


def _validation_ended(batch_id: str, to: BatchStatus, total: int, **values: Any) -> Update:
    """validating -> `to`: the validator's lease released, the counts starting from the file's lines."""
    return _move(
        batch_id,
        (BatchStatus.validating,),
        to,
        lease_until=None,
        request_counts={**EMPTY_COUNTS, "total": total},
        **values,
    )


def validated(batch_id: str, now: datetime, total: int, model: str | None = None) -> Update:
    """`model`: what its lines ask for (core/batches/ingest.py `Validation.model`)."""
    return _validation_ended(batch_id, BatchStatus.in_progress, total, in_progress_at=now, model=model)


def rejected(batch_id: str, now: datetime, total: int, errors: dict[str, Any], model: str | None = None) -> Update:
    """`errors`: the list object the batch shows (render.listing; workers import this module, so it
    renders nothing itself); `model`: what its valid lines ask for."""
    return _validation_ended(batch_id, BatchStatus.failed, total, failed_at=now, errors=errors, model=model)


def cancel_requested(batch_id: str, now: datetime) -> Update:
    return _move(batch_id, CANCELLABLE, BatchStatus.cancelling, cancelling_at=now)


def cancelled(batch_id: str, now: datetime) -> Update:
    """cancelling -> cancelled, for a batch whose validation was cancelled (no line ever ran)."""
    return _move(batch_id, (BatchStatus.cancelling,), BatchStatus.cancelled, cancelled_at=now)


def ending(b: Batch) -> BatchStatus:
    """What a live batch with no live lines becomes (cancelled ones keep `cancelling_at` while finalizing)."""
    if b.status == BatchStatus.cancelling or b.cancelling_at is not None:
        return BatchStatus.cancelled
    return BatchStatus.expired if b.expired_at else BatchStatus.completed


def finalizing(b: Batch, now: datetime) -> None:
    """A live batch locked FOR UPDATE by the caller, with no live line left -> finalizing: its result
    files are written, a slice per pass."""
    assert b.status in (BatchStatus.in_progress, BatchStatus.cancelling)
    b.finalizing_at = b.finalizing_at or now
    b.status = BatchStatus.finalizing.value


def end(b: Batch, final: BatchStatus, now: datetime) -> None:
    """A finalizing batch locked FOR UPDATE by the caller -> its final status, stamped."""
    assert final in FINAL and b.status == BatchStatus.finalizing
    b.status = final.value
    setattr(b, f"{final.value}_at", now)
