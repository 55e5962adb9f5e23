"""The one backoff (core/infra/backoff.py): its pauses, its deadline, and what `retry` waits out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from redis import exceptions as rx

from core.infra import backoff
from core.infra.backoff import Backoff, retry


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for the backoff module alone: sleeping advances it."""
    now = [1000.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(backoff, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    return slept


def test_pauses_double_from_a_fifth_of_a_second_to_the_cap():
    b = Backoff()
    assert [b.step() for _ in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    b.reset()
    assert b.step() == 0.2
    low = Backoff(cap_s=1.0)
    assert [low.step() for _ in range(4)] == [0.2, 0.4, 0.8, 1.0]
    # the first pause is the first pause even under a lower cap (a very short lease)
    assert Backoff(cap_s=0.1).step() == 0.2
    assert Backoff(cap_s=60.0).cap_s == backoff.MAX_S


def test_retry_waits_a_transient_error_out(clock):
    calls = iter(range(10))
    waits: list[tuple[str, float]] = []

    def flaky() -> str:
        if next(calls) < 3:
            raise rx.ConnectionError("away")
        return "ok"

    got = retry(flaky, Backoff(60), on_wait=lambda exc, pause: waits.append((type(exc).__name__, pause)))
    assert got == "ok" and clock == [0.2, 0.4, 0.8]
    assert waits == [("ConnectionError", 0.2), ("ConnectionError", 0.4), ("ConnectionError", 0.8)]


def test_past_the_deadline_the_error_is_raised_or_given_up(clock):
    def away() -> None:
        raise rx.ConnectionError("away")

    with pytest.raises(rx.ConnectionError):
        retry(away, Backoff(1.0))
    assert clock == [0.2, 0.4]  # a third pause (0.8) would have ended past 1.0 s
    clock.clear()
    assert retry(away, Backoff(1.0), give_up=lambda exc: f"gave up: {type(exc).__name__}") == (
        "gave up: ConnectionError"
    )


def test_other_errors_are_raised_at_once(clock):
    def bug() -> None:
        raise rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    def away() -> None:
        raise rx.ConnectionError("away")

    with pytest.raises(rx.ResponseError):
        retry(bug, Backoff(60))
    # `retry_on` says what is waited out: a tuple of classes (redis-py's ConnectionError is no OSError)
    with pytest.raises(rx.ConnectionError):
        retry(away, Backoff(60), retry_on=(OSError,))
    assert clock == []


def test_what_on_wait_raises_is_raised_as_it_is(clock):
    def away() -> None:
        raise rx.ConnectionError("away")

    def fenced(exc: Exception, pause: float) -> None:
        raise LookupError("fenced")

    with pytest.raises(LookupError):
        retry(away, Backoff(60), on_wait=fenced, give_up=lambda exc: None)
    assert clock == []
