"""A pass that follows a wake (a worker freed batch slots) or a send refills batch slots only once a
message's worth is free (`Dispatcher.refill_at`): before, every line that ended cost the dispatcher a
full pass of its own (~6 ms of CPU a line at 64 slots). A pass after a quiet interval, and every
upkeep pass, still fills whatever is free. Real Postgres and Redis, in-process; `_send` counts what
would go to Celery."""

from __future__ import annotations

import time

from sqlalchemy import select

from core.dispatcher import Dispatcher
from core.infra.orm import Job
from core.jobs import live_workers
from core.states import JobState
from ops import factories

MODEL = "refill-model"  # its own model: other tests' lines hold no slot of it


def test_a_woken_pass_waits_for_a_messages_worth_of_free_slots(session, sessions, rds, it_settings):
    settings = it_settings.model_copy(update={"models": MODEL, "batch_prefetch": 3, "batch_group": 8})
    t = factories.tenant(session)
    b = factories.batch(session, t, lines=0)
    for i in range(12):
        j = factories.job(session, t, kind="batch", model=MODEL)
        j.batch_id, j.line_no, j.custom_id = b.id, i + 1, f"r{i}"
    session.commit()
    live_workers.beat(rds, MODEL, "refill-worker", batch_slots=5, interactive_slots=0)
    d = Dispatcher(sessions, rds, rds, settings)
    assert d.refill_at == 3  # min(batch_group, batch_prefetch)
    sent: list[str] = []
    d._send = lambda _s, rows: sent.extend(r[0] for r in rows) or len(rows)  # type: ignore[method-assign]
    d._next_upkeep = time.monotonic() + 3600  # no upkeep pass here: it always fills

    def in_flight() -> int:
        session.expire_all()
        q = select(Job.id).where(Job.model == MODEL, Job.state == JobState.dispatched.value)
        return len(session.scalars(q).all())

    d.tick()  # a plain pass fills all 5 slots
    assert len(sent) == 5 and in_flight() == 5

    def end(n: int) -> None:
        for job_id in sent[:n]:
            row = session.get(Job, job_id)
            if row.state == JobState.dispatched.value:
                row.state = JobState.succeeded.value
        session.commit()
        del sent[:n]

    end(2)  # two slots free: fewer than refill_at
    assert d.tick(woken=True)["sent"] == 0 and in_flight() == 3
    end(1)  # three free: a message's worth
    assert d.tick(woken=True)["sent"] == 3 and in_flight() == 5
    end(1)  # one free; a pass after a quiet interval fills it all the same
    assert d.tick(woken=True)["sent"] == 0
    assert d.tick()["sent"] == 1 and in_flight() == 5
    live_workers.gone(rds, MODEL, "refill-worker")
