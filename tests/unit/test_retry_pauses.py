"""An attempt waiting for Redis or Postgres keeps its lease: `retrying` never pauses longer than a
third of the lease between the renewals it runs (`on_wait`). With a 3 s lease and the old 5 s cap,
a 30 s Redis outage let the lease lapse and a second attempt took the job over (ops/faults.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from core.config import Settings
from core.infra import backoff
from workers import retry


@pytest.mark.parametrize("lease_s", [3.0, 30.0])
def test_pauses_stay_within_a_third_of_the_lease(monkeypatch, lease_s):
    timeline: list[tuple[str, float]] = []
    # the backoff's own `time` only: patching the shared module would also speed up every other thread's
    # sleep (a cancel watch left by an earlier test spun 20,000 times into this timeline)
    fake_time = SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: timeline.append(("sleep", s)))
    monkeypatch.setattr(backoff, "time", fake_time)
    calls = iter(range(30))

    def flaky() -> str:
        if next(calls) < 25:
            raise ConnectionError("redis away")
        return "ok"

    settings = Settings(lease_s=lease_s, infra_retry_s=3600)
    assert retry.retrying(settings, "publish", flaky, on_wait=lambda: timeline.append(("renew", 0.0))) == "ok"

    pauses = [s for what, s in timeline if what == "sleep"]
    assert len(pauses) == 25 and max(pauses) <= min(5.0, lease_s / 3)
    # each pause follows a renewal
    assert all(timeline[i - 1][0] == "renew" for i, (what, _) in enumerate(timeline) if what == "sleep")
