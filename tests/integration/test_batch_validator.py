"""The batch validator shares its time between tenants, compiles each distinct constraint once and
holds its lease (issue 49): before, it was one FIFO thread for all tenants (one tenant's large file
made every other tenant's batch wait behind it), compiled every line's grammar again, and never
renewed its 300 s lease, so a long validation was taken over by a second dispatcher.

Real Postgres and Redis, in-process: `run_validator` in a thread as `spool dispatcher` runs it, and
`claim_next` as a second dispatcher's validator would call it. The database is shared with the other
integration tests: every assertion is about this test's own tenants, removed after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

from core.batches import ingest
from core.batches.transitions import cancel_requested
from core.generation import constraints
from core.infra.orm import Batch, Job
from core.states import BatchStatus
from ops import factories
from ops.harness import wait_for

# Most of the module's time is waiting: validations slowed past their leases on purpose.
pytestmark = pytest.mark.wallclock

MODEL = "smollm2-135m-instruct"


def _line(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"r{i}",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **body},
    }


@pytest.fixture
def batch(session, sessions) -> Iterator[Callable[..., str]]:
    """Makes batches awaiting validation, each of a tenant of its own unless given one; removes their
    tenants (batches, lines and files with them) after the test."""
    made: list[int] = []

    def make(lines: list[dict[str, Any]], age_s: float = 0.0) -> str:
        t = factories.tenant(session)
        made.append(t.id)
        _, key = factories.api_key(session, t)
        return factories.validating_batch(session, t, key, lines, chunk_bytes=64 * 1024, age_s=age_s)

    yield make
    session.rollback()
    factories.remove_tenants(sessions, made)


def _row(sessions, bid: str) -> Batch:
    with sessions() as s:
        b = s.get(Batch, bid)
        assert b is not None
        return b


def _jobs(sessions, bid: str) -> int:
    with sessions() as s:
        return int(s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == bid)) or 0)


class _Running:
    """`run_validator` in a thread, stopped (and joined) on exit."""

    def __init__(self, sessions, rds, settings) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=ingest.run_validator, args=(sessions, rds, settings), kwargs={"poll_s": 0.2, "stop": self.stop}
        )

    def __enter__(self) -> _Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def test_a_small_batch_of_another_tenant_is_validated_before_a_large_one_ends(sessions, rds, it_settings, batch):
    """Before: batches were validated one whole file at a time, oldest first: tenant B's three lines
    waited for all of tenant A's 1,500."""
    settings = it_settings.model_copy(update={"batch_validation_slice_lines": 50})
    large = batch([_line(i) for i in range(1500)], age_s=10)
    small = batch([_line(i) for i in range(3)], age_s=5)  # submitted after the large one

    with _Running(sessions, rds, settings):
        wait_for(
            lambda: all(_row(sessions, b).status != BatchStatus.validating for b in (large, small)),
            120,
            "both batches validated",
        )

    a, b = _row(sessions, large), _row(sessions, small)
    assert a.status == b.status == BatchStatus.in_progress
    assert a.in_progress_at is not None and b.in_progress_at is not None
    assert b.in_progress_at < a.in_progress_at, "the small batch waited for the whole large one"
    assert (_jobs(sessions, large), _jobs(sessions, small)) == (1500, 3)


class _CountingMatcher:
    """constraints.LLMatcher with its compilations counted: every constraint compiled ends in exactly
    one `validate_grammar` (core/generation/constraints.py `compiled`)."""

    def __init__(self) -> None:
        self.real, self.compiled = constraints.LLMatcher, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def validate_grammar(self, grammar: str, *args: Any) -> Any:
        self.compiled += 1
        return self.real.validate_grammar(grammar, *args)


def test_a_thousand_lines_with_one_schema_compile_it_once(sessions, it_settings, batch, monkeypatch):
    """Before: every line's constraint was compiled again (1,001 compilations here). The one line whose
    schema lists the same properties in another order gets a grammar of its own: key order is the
    order the grammar makes the model write them in."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    lines = [_line(i, json_schema=schema) for i in range(1000)] + [_line(1000, json_schema=reordered)]
    bid = batch(lines)
    counter = _CountingMatcher()
    monkeypatch.setattr(constraints, "LLMatcher", counter)

    assert ingest.validate(sessions, bid, it_settings) == BatchStatus.in_progress, _row(sessions, bid).errors

    assert counter.compiled == 2
    with sessions() as s:
        grammars = s.execute(select(Job.line_no, Job.params["grammar"].astext).where(Job.batch_id == bid)).all()
    assert len(grammars) == 1001
    by_line = dict(grammars)
    assert len({by_line[n] for n in range(1, 1001)}) == 1
    assert by_line[1001] != by_line[1] and by_line[1001]


def _slowed(monkeypatch, per_line_s: float, on_line: Callable[[int], None] = lambda n: None) -> list[int]:
    """Each line's validation slowed by `per_line_s` (time passing is the point: a validation longer
    than its lease), `on_line` called with each line number first; returns the line numbers seen."""
    seen: list[int] = []
    real = ingest._job_row

    def job_row(line_no: int, *args: Any, **kw: Any) -> Any:
        seen.append(line_no)
        on_line(line_no)
        time.sleep(per_line_s)
        return real(line_no, *args, **kw)

    monkeypatch.setattr(ingest, "_job_row", job_row)
    return seen


def test_a_validation_longer_than_its_lease_keeps_it(sessions, rds, it_settings, batch, monkeypatch):
    """Before: the lease was never renewed: 3 s into this validation a second validator took the batch
    (and would have validated it again)."""
    lease_s = 3.0
    settings = it_settings.model_copy(update={"batch_validation_lease_s": lease_s, "batch_validation_slice_lines": 50})
    bid = batch([_line(i) for i in range(120)])
    seen = _slowed(monkeypatch, 0.05)  # 120 lines: about 6 s, twice the lease
    taken = []
    with _Running(sessions, rds, settings):
        first = wait_for(lambda: seen and _row(sessions, bid).lease_until, 30, "the batch claimed")
        while _row(sessions, bid).status == BatchStatus.validating:
            claim = ingest.claim_next(sessions, lease_s)  # a second dispatcher's validator
            if claim is not None:
                taken.append(claim)
            time.sleep(0.1)  # the second validator polls, as run_validator does between waits

    b = _row(sessions, bid)
    assert not taken, f"a second validator took the batch mid-validation: {taken}"
    assert b.status == BatchStatus.in_progress and b.in_progress_at is not None
    assert b.in_progress_at > first, "the validation did not outlive its first lease"
    assert _jobs(sessions, bid) == 120


def test_a_validator_whose_lease_was_taken_commits_nothing(sessions, rds, it_settings, batch, monkeypatch):
    """Before: a validator went on to commit a batch whose lease another had taken meanwhile; the one
    that took it validated the file again. Now only the lease's holder commits: one set of lines."""
    settings = it_settings.model_copy(update={"batch_validation_lease_s": 60.0, "batch_validation_slice_lines": 50})
    bid = batch([_line(i) for i in range(120)])
    thief: list[Any] = []

    def steal(line_no: int) -> None:
        if line_no == 10 and not thief:  # the first validator's lease lapses (as if it stalled) and another takes it
            with sessions() as s:
                s.execute(update(Batch).where(Batch.id == bid).values(lease_until=func.now() - timedelta(seconds=1)))
                s.commit()
            thief.append(ingest.claim_next(sessions, 60.0))

    seen = _slowed(monkeypatch, 0.0, steal)
    with _Running(sessions, rds, settings):
        wait_for(lambda: 120 in seen, 60, "the first validator through the file")
        # Stopping waits for the step in hand: the first validator's end of this batch, commit or not.

    assert thief and thief[0] is not None, "the lapsed lease could not be taken"
    b = _row(sessions, bid)
    assert b.status == BatchStatus.validating, f"the validator without the lease moved the batch to {b.status}"
    assert _jobs(sessions, bid) == 0

    assert ingest.validate(sessions, bid, settings, lease=thief[0].lease_until) == BatchStatus.in_progress
    assert _jobs(sessions, bid) == 120  # the holder's lines, once


def test_a_validator_stops_at_the_renewal_that_finds_its_lease_taken(sessions, rds, it_settings, batch, monkeypatch):
    """Before: a validator never looked at its lease again and committed the batch under another's."""
    settings = it_settings.model_copy(update={"batch_validation_lease_s": 0.3, "batch_validation_slice_lines": 20})
    bid = batch([_line(i) for i in range(100)])
    taken: list[int] = []

    def take(line_no: int) -> None:
        if line_no == 10 and not taken:  # another validator's lease, as its claim would set it
            with sessions() as s:
                s.execute(update(Batch).where(Batch.id == bid).values(lease_until=func.now() + timedelta(minutes=10)))
                s.commit()
            taken.append(line_no)

    seen = _slowed(monkeypatch, 0.01, take)  # 100 lines: about 1 s, past the next renewal (0.1 s)
    with _Running(sessions, rds, settings):
        wait_for(lambda: taken, 30, "the lease taken")
        time.sleep(1.5)  # what the first validator does with the time it would need for the rest of the file

    assert max(seen) < 100, "the validator went on through the file without its lease"
    assert _row(sessions, bid).status == BatchStatus.validating and _jobs(sessions, bid) == 0


def test_a_batch_cancelled_while_validating_stops_at_the_next_renewal(sessions, rds, it_settings, batch, monkeypatch):
    """Before: the whole file was validated first, then thrown away."""
    settings = it_settings.model_copy(update={"batch_validation_lease_s": 0.3, "batch_validation_slice_lines": 20})
    bid = batch([_line(i) for i in range(100)])

    def cancel(line_no: int) -> None:
        if line_no == 10:
            with sessions() as s:
                s.execute(cancel_requested(bid, datetime.now(UTC)))
                s.commit()

    seen = _slowed(monkeypatch, 0.01, cancel)
    with _Running(sessions, rds, settings):
        wait_for(lambda: _row(sessions, bid).status == BatchStatus.cancelled, 30, "the batch cancelled")

    assert max(seen) < 100 and _jobs(sessions, bid) == 0
