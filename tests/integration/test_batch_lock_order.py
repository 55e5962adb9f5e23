"""A worker ending a batch line and the batch keeper cancelling that batch's queued lines take the
same two locks, the batch row (the line counters' trigger) and the day's usage row: both must take
them in the same order, or Postgres kills one of them as a deadlock. With the keeper the usual
victim, a cancelled batch whose workers keep ending lines was never finalized (a CI failure: a
20,000-line batch stuck in `cancelling` for two minutes). Real Postgres and Redis, in-process."""

from __future__ import annotations

import threading

from sqlalchemy import func, select, text

from core.generation.events import ChoiceResult, JobResult, Usage
from core.infra.orm import Batch, Job, UsageDaily
from core.jobs.lifecycle import Lifecycle
from core.states import BatchStatus, Ending, JobState
from ops import factories
from tests.conftest import wait_for

LINES = 6


def test_a_line_ending_while_the_keeper_cancels_its_batch_does_not_deadlock(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    b = factories.batch(session, t, status=BatchStatus.cancelling, lines=LINES, key_id=5)
    first = session.scalars(select(Job).where(Job.batch_id == b.id).order_by(Job.line_no)).first()
    assert first is not None
    first.state, first.attempt, first.started_at = JobState.running.value, 1, func.now()
    session.commit()
    life = Lifecycle(sessions, rds, it_settings)
    result = JobResult(choices=[ChoiceResult(index=0, text="x", finish_reason="length")])

    with sessions() as keeper:
        # The keeper's pass: the batch row first (FOR UPDATE), as progress.advance takes it.
        keeper.execute(select(Batch).where(Batch.id == b.id).with_for_update())
        # A worker ends the running line meanwhile: it must wait for the batch row...
        ended: list[bool] = []
        errors: list[BaseException] = []

        def end_line() -> None:
            try:
                ended.append(life.succeed(first, result, Usage(prompt_tokens=3, completion_tokens=1), 0.1))
            except BaseException as exc:  # a deadlock victim: reported below
                errors.append(exc)

        worker = threading.Thread(target=end_line)
        worker.start()

        def worker_blocked() -> bool:
            with sessions() as probe:
                q = (
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND wait_event_type = 'Lock'"
                )
                return probe.execute(text(q)).first() is not None

        wait_for(worker_blocked, 10, "the worker's ending to wait for the batch row", interval=0.02)
        # ...without holding the usage row the keeper's cancel counts its lines in.
        keeper.execute(text("SET LOCAL lock_timeout = '5s'"))  # a wrong order fails, never hangs
        rows = life.end_queued_lines(keeper, b.id, Ending.cancelled, 100)
        keeper.commit()
    worker.join(10)
    assert not errors, errors
    assert ended == [True]
    assert len(rows) == LINES - 1
    session.expire_all()
    states = dict(
        session.execute(select(Job.state, func.count()).where(Job.batch_id == b.id).group_by(Job.state)).all()
    )
    assert states == {"succeeded": 1, "cancelled": LINES - 1}
    bt = session.get(Batch, b.id, populate_existing=True)
    assert (bt.lines_completed, bt.lines_failed) == (1, LINES - 1)  # the trigger counted every line once
    u = session.execute(
        select(func.sum(UsageDaily.requests), func.sum(UsageDaily.failed)).where(UsageDaily.tenant_id == t.id)
    ).one()
    assert (u[0], u[1]) == (LINES, LINES - 1)
