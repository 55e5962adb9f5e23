"""Batch bookkeeping off the dispatcher's tick, in slices, with counts kept as lines end (issue 25).

Real Postgres and Redis, in-process: the batch keeper's own pass (`progress.advance`)."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import event, func, select, text, update

from core.batches import progress
from core.dispatcher import Dispatcher
from core.generation.events import ChoiceResult, ErrorInfo, JobResult, Usage
from core.infra.db import Listener
from core.infra.orm import Batch, File, FileChunk, Job
from core.jobs.lifecycle import Lifecycle
from core.states import FINAL, BatchStatus, JobState
from ops import factories


def _expired_batch(session, lines: int, expired: bool = True) -> str:
    t = factories.tenant(session)
    return factories.batch(session, t, lines=lines, window_left_s=-4 if expired else 3600).id


def _drain(session, sessions, lifecycle, batch_id: str, slice_rows: int, passes: int = 20) -> int:
    """Keeper passes until the batch is final; returns how many it took."""
    for n in range(1, passes + 1):
        progress.advance(sessions, lifecycle, slice_rows=slice_rows)
        if session.get(Batch, batch_id, populate_existing=True).status in FINAL:
            return n
    raise AssertionError(f"batch {batch_id} not final after {passes} passes")


def _states(session, batch_id: str) -> dict[str, int]:
    session.expire_all()
    rows = session.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id).group_by(Job.state))
    return dict(rows.all())


def test_an_expired_batch_is_worked_through_in_slices(session, sessions, rds, it_settings):
    lifecycle = Lifecycle(sessions, rds, it_settings)
    batch_id = _expired_batch(session, 12)
    progress.advance(sessions, lifecycle, slice_rows=5)
    assert _states(session, batch_id) == {"expired": 5, "queued": 7}
    assert session.get(Batch, batch_id).status == BatchStatus.in_progress  # not finalized meanwhile
    progress.advance(sessions, lifecycle, slice_rows=5)
    progress.advance(sessions, lifecycle, slice_rows=5)
    assert _states(session, batch_id) == {"expired": 12}
    _drain(session, sessions, lifecycle, batch_id, 5)
    b = session.get(Batch, batch_id, populate_existing=True)
    assert b.status == BatchStatus.expired and progress.counts(b) == {"total": 12, "completed": 0, "failed": 12}
    assert b.error_file_id is not None and b.output_file_id is None


def test_the_dispatch_tick_does_no_batch_bookkeeping(session, sessions, rds, it_settings, monkeypatch):
    """Before: every tick expired and rendered batches itself, holding dispatch, reaping and re-sends."""
    batch_id = _expired_batch(session, 3)

    def refuse(*_a, **_k):
        raise AssertionError("batch bookkeeping inside the dispatch tick")

    d = Dispatcher(sessions, rds, rds, it_settings)
    monkeypatch.setattr(d, "_send", lambda _s, rows: len(rows))  # no Celery here
    monkeypatch.setattr(progress, "advance", refuse)
    d.tick()
    assert _states(session, batch_id) == {"queued": 3}
    monkeypatch.undo()
    d.keep_batches()  # the keeper thread's pass does it
    assert _states(session, batch_id) == {"expired": 3}


def _run(session, job_id: str) -> Job:
    """A queued line -> running, as a worker's claim leaves it (attempt 1, lease held)."""
    job = session.get(Job, job_id, populate_existing=True)
    job.state, job.started_at = JobState.running.value, datetime.now(UTC)
    job.lease_until = datetime.now(UTC) + timedelta(seconds=60)
    session.commit()
    return job


def _result(text: str) -> JobResult:
    return JobResult(choices=[ChoiceResult(index=0, text=text, finish_reason="length")])


def test_counts_are_kept_as_lines_end_whoever_ends_them(session, sessions, rds, it_settings):
    """Before: counts were a GROUP BY over the batch's jobs on every read and every keeper pass, and
    the row held no count until the batch ended. Now each ending (a worker's success or failure, the
    owner's cancel, the reaper, the keeper's expiry) counts itself once, in its own transaction."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    batch_id = _expired_batch(session, 10, expired=False)
    ids = [j for (j,) in session.execute(select(Job.id).where(Job.batch_id == batch_id).order_by(Job.line_no))]
    tenant_id = session.get(Batch, batch_id).tenant_id
    for j in ids[:4]:
        job = _run(session, j)
        assert lifecycle.succeed(job, _result("ok"), Usage(completion_tokens=1), 0.1)
        assert not lifecycle.succeed(job, _result("ok"), Usage(completion_tokens=1), 0.1)  # a duplicate: no-op
    assert lifecycle.fail(_run(session, ids[4]), ErrorInfo(message="boom", type="server_error"), Usage())
    assert lifecycle.cancel(ids[5], tenant_id) is not None
    assert lifecycle.cancel(ids[5], tenant_id) is not None  # a second cancel counts nothing
    lapsed = _run(session, ids[6])
    lapsed.attempt, lapsed.lease_until = it_settings.max_attempts, datetime.now(UTC) - timedelta(seconds=1)
    session.commit()
    lifecycle.reap()
    b = session.get(Batch, batch_id, populate_existing=True)
    assert progress.counts(b) == {"total": 10, "completed": 4, "failed": 3}
    truth = _states(session, batch_id)
    assert truth == {"succeeded": 4, "failed": 2, "cancelled": 1, "queued": 3}
    # The window ends: the keeper expires the rest, finalizes, and the counts stay exact.
    b.expires_at = datetime.now(UTC) - timedelta(seconds=1)
    session.commit()
    _drain(session, sessions, lifecycle, batch_id, 5)
    b = session.get(Batch, batch_id, populate_existing=True)
    assert b.status == BatchStatus.expired
    assert progress.counts(b) == {"total": 10, "completed": 4, "failed": 6}


def test_the_keeper_never_recounts_a_batchs_lines(session, sessions, rds, it_settings):
    """The keeper's passes over a live batch read its row and probe for a live line; no statement
    aggregates over its jobs (before: a GROUP BY over every live batch's lines, every second)."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    _expired_batch(session, 6, expired=False)
    seen: list[str] = []
    engine = sessions.kw["bind"]

    def record(_conn, _cursor, statement, *_a):
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        progress.advance(sessions, lifecycle, slice_rows=5)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert any("FROM batches" in q for q in seen), seen  # the pass did look at the batch
    assert not [q for q in seen if "GROUP BY" in q.upper() or "count(" in q.lower()], seen


def test_result_files_are_written_in_slices_and_shown_only_when_whole(session, sessions, rds, it_settings):
    """Before: a batch's every line was rendered into its files in the one pass that ended it. Now
    each pass writes a slice and commits; the batch reads `finalizing` meanwhile, its files hidden."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    batch_id = _expired_batch(session, 12, expired=False)
    ids = [j for (j,) in session.execute(select(Job.id).where(Job.batch_id == batch_id).order_by(Job.line_no))]
    for i, j in enumerate(ids):
        if i % 4 == 3:
            assert lifecycle.fail(_run(session, j), ErrorInfo(message=f"bad {i}", type="server_error"), Usage())
        else:
            assert lifecycle.succeed(_run(session, j), _result(f"line {i}"), Usage(completion_tokens=1), 0.1)
    tenant_id = session.get(Batch, batch_id).tenant_id

    progress.advance(sessions, lifecycle, slice_rows=5)
    b = session.get(Batch, batch_id, populate_existing=True)
    assert b.status == BatchStatus.finalizing and b.results_line == 5
    shown = progress.batch_json(b)
    assert shown["status"] == "finalizing" and shown["output_file_id"] is None and shown["error_file_id"] is None
    visible = session.scalars(select(File.id).where(File.tenant_id == tenant_id, File.deleted.is_(False))).all()
    assert visible == []  # a half-written file is not listed or downloadable

    assert _drain(session, sessions, lifecycle, batch_id, 5) == 2  # lines 6-10, then 11-12 and the end
    b = session.get(Batch, batch_id, populate_existing=True)
    assert b.status == BatchStatus.completed and progress.counts(b) == {"total": 12, "completed": 9, "failed": 3}

    def lines(file_id: str) -> list[dict]:
        f = session.get(File, file_id, populate_existing=True)
        assert f.status == "processed" and not f.deleted
        raw = b"".join(
            session.scalars(select(FileChunk.data).where(FileChunk.file_id == file_id).order_by(FileChunk.seq))
        )
        out = [json.loads(x) for x in raw.splitlines()]
        assert f.lines == len(out) and f.bytes == len(raw)
        return out

    ok, bad = lines(b.output_file_id), lines(b.error_file_id)
    assert [x["custom_id"] for x in ok] == [f"r{i}" for i in range(12) if i % 4 != 3]  # input order, none twice
    assert [x["response"]["body"]["choices"][0]["text"] for x in ok] == [f"line {i}" for i in range(12) if i % 4 != 3]
    assert [x["custom_id"] for x in bad] == ["r3", "r7", "r11"]
    assert [x["response"]["body"]["error"]["message"] for x in bad] == ["bad 3", "bad 7", "bad 11"]


def test_a_pass_that_dies_mid_slice_leaves_nothing_half_written(session, sessions, rds, it_settings, monkeypatch):
    """The keeper's process dies while writing a slice (here: its writer raises after a few lines):
    that slice's transaction rolls back whole, and the next pass writes every line exactly once."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    batch_id = _expired_batch(session, 12, expired=False)
    ids = [j for (j,) in session.execute(select(Job.id).where(Job.batch_id == batch_id).order_by(Job.line_no))]
    for i, j in enumerate(ids):
        assert lifecycle.succeed(_run(session, j), _result(f"line {i}"), Usage(completion_tokens=1), 0.1)
    progress.advance(sessions, lifecycle, slice_rows=5)  # lines 1-5 written
    real = progress.files.ChunkWriter.write
    written = []

    def dying(self, data):
        written.append(data)
        if len(written) == 3:
            raise RuntimeError("killed mid-slice")
        real(self, data)

    monkeypatch.setattr(progress.files.ChunkWriter, "write", dying)
    progress.advance(sessions, lifecycle, slice_rows=5)  # the keeper logs and goes on; nothing kept
    monkeypatch.undo()
    b = session.get(Batch, batch_id, populate_existing=True)
    assert b.status == BatchStatus.finalizing and b.results_line == 5
    _drain(session, sessions, lifecycle, batch_id, 5)
    b = session.get(Batch, batch_id, populate_existing=True)
    raw = b"".join(
        session.scalars(select(FileChunk.data).where(FileChunk.file_id == b.output_file_id).order_by(FileChunk.seq))
    )
    assert [json.loads(x)["custom_id"] for x in raw.splitlines()] == [f"r{i}" for i in range(12)]


def test_the_last_line_to_end_notifies_once_when_its_ending_commits(session, sessions, rds, it_settings):
    """Migration 0011: the ending that brings a batch's counts to its total NOTIFYs the keeper with the
    batch's id; earlier endings do not, and nothing is sent before the ending commits."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    batch_id = _expired_batch(session, 3, expired=False)
    ids = [j for (j,) in session.execute(select(Job.id).where(Job.batch_id == batch_id).order_by(Job.line_no))]
    listener = Listener(sessions.kw["bind"], progress.LINES_ENDED)
    try:
        listener.start()
        assert lifecycle.succeed(_run(session, ids[0]), _result("a"), Usage(completion_tokens=1), 0.1)
        assert lifecycle.fail(_run(session, ids[1]), ErrorInfo(message="boom", type="server_error"), Usage())
        assert listener.wait(0.3) is None  # one line still live
        last = _run(session, ids[2])
        with sessions() as other:
            other.execute(update(Job).where(Job.id == last.id).values(state=JobState.succeeded.value))
            assert listener.wait(0.3) is None  # not committed yet
            other.commit()
        assert listener.wait(10) == batch_id
        assert listener.wait(0.3) is None  # once
    finally:
        listener.close()


def test_the_keeper_finalizes_a_batch_when_its_last_line_ends_not_at_its_next_pass(session, sessions, rds, it_settings):
    """Before: a finished batch waited for the keeper's next timed pass (up to `dispatcher_interval_s`).
    Here that interval is a minute; the batch completes, with its output file, as its last line ends."""
    settings = it_settings.model_copy(update={"dispatcher_interval_s": 60.0})
    lifecycle = Lifecycle(sessions, rds, settings)
    batch_id = _expired_batch(session, 2, expired=False)
    ids = [j for (j,) in session.execute(select(Job.id).where(Job.batch_id == batch_id).order_by(Job.line_no))]
    stop, passed = threading.Event(), threading.Event()
    d = Dispatcher(sessions, rds, rds, settings)
    keep = d.keep_batches

    def counted() -> dict[str, int]:
        out = keep()
        passed.set()
        return out

    d.keep_batches = counted  # type: ignore[method-assign]
    assert lifecycle.succeed(_run(session, ids[0]), _result("a"), Usage(completion_tokens=1), 0.1)
    keeper = threading.Thread(target=d.run_batch_keeper, args=(stop,))
    keeper.start()
    try:
        assert passed.wait(20)  # its first pass found a live line; now it waits its minute
        assert session.get(Batch, batch_id, populate_existing=True).status == BatchStatus.in_progress
        assert lifecycle.succeed(_run(session, ids[1]), _result("b"), Usage(completion_tokens=1), 0.1)
        deadline = time.monotonic() + 20  # a third of the interval: only the notification explains it
        while session.get(Batch, batch_id, populate_existing=True).status != BatchStatus.completed:
            assert time.monotonic() < deadline, "not finalized when its last line ended"
            time.sleep(0.1)
        b = session.get(Batch, batch_id)
        assert progress.counts(b) == {"total": 2, "completed": 2, "failed": 0} and b.output_file_id is not None
    finally:
        stop.set()
        with sessions() as s:  # wake it so it sees the stop
            s.execute(text("SELECT pg_notify(:c, '')"), {"c": progress.LINES_ENDED})
            s.commit()
        keeper.join(10)
    assert not keeper.is_alive()
