"""Batch lines and pre-body request checks against the real Redis limit scripts (issue 25)."""

from __future__ import annotations

import asyncio
import secrets

import redis.asyncio as aioredis

from core.tenancy import admission, limits
from tests.integration.conftest import IT_REDIS


def _tenant() -> int:
    return secrets.randbelow(1 << 40) + 1_000_000  # keys of its own in the shared test Redis db


def _line(tenant: int, cost: int = 10, tpd: int = 0, max_queued: int = 0) -> admission.Line:
    return admission.Line("cmpl-" + secrets.token_hex(8), tenant, 0, cost, tpd, max_queued)


def test_lines_past_max_queued_wait_and_go_once_a_line_settles(rds):
    t = _tenant()
    lines = [_line(t, max_queued=2) for _ in range(3)]
    wait, over = admission.admit_lines(rds, lines)
    assert wait == {lines[2].job_id} and over == {}
    assert rds.zcard(f"rl:t{t}:active") == 2
    limits.settle(rds, lines[0].job_id, 5)  # a line ends: its place is free
    wait, over = admission.admit_lines(rds, [lines[2]])
    assert wait == set() and over == {}


def test_lines_take_the_daily_quota_and_past_it_fail_naming_it(rds):
    t = _tenant()
    a, b = _line(t, cost=60, tpd=100), _line(t, cost=60, tpd=100)
    wait, over = admission.admit_lines(rds, [a, b])
    assert wait == set() and list(over) == [b.job_id]
    assert "Daily token quota" in over[b.job_id] and "100" in over[b.job_id]
    limits.settle(rds, a.job_id, 20)  # settled to what it really used: 40 tokens back
    assert admission.admit_lines(rds, [b]) == (set(), {})


def test_a_line_sent_again_after_a_lost_worker_takes_nothing_twice(rds):
    t = _tenant()
    a = _line(t, cost=60, tpd=100, max_queued=1)
    assert admission.admit_lines(rds, [a]) == (set(), {})
    assert admission.admit_lines(rds, [a]) == (set(), {})  # the reaper re-queued it: same reservation
    day_keys = list(rds.scan_iter(f"rl:t{t}:tpd:*"))
    assert [int(rds.get(k)) for k in day_keys] == [60]


def test_lines_of_tenants_without_limits_cost_no_round_trip():
    class NoRedis:
        def pipeline(self, **_):
            raise AssertionError("no Redis call expected")

    assert admission.admit_lines(NoRedis(), [_line(1), _line(2)]) == (set(), {})


def test_the_request_check_takes_rpm_once_and_admission_does_not_take_it_again():
    async def go() -> None:
        r = aioredis.Redis.from_url(IT_REDIS)
        t = _tenant()
        first = await limits.take_request(r, t, t, 2, 0)
        second = await limits.take_request(r, t, t, 2, 0)
        third = await limits.take_request(r, t, t, 2, 0)
        assert first.allowed and second.allowed and not third.allowed
        assert third.refused == "requests" and third.retry_after_s and third.retry_after_s > 0
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        # Admission with the request already taken checks tokens only: it passes though rpm is spent.
        token = admission.REQUEST_TAKEN.set(second.headers)
        try:
            p = _principal(t, rpm=2)
            headers = await admission.admit(r, p, "cmpl-" + secrets.token_hex(8), 5)
            assert headers["x-ratelimit-limit-requests"] == "2"
        finally:
            admission.REQUEST_TAKEN.reset(token)
        await r.aclose()

    asyncio.run(go())


def _principal(tenant_id: int, rpm: int):
    from types import SimpleNamespace

    tenant = SimpleNamespace(id=tenant_id, rpm=rpm, tpm=None, tpd=None, max_queued=None)
    key = SimpleNamespace(id=tenant_id, rpm=None, tpm=None)
    return SimpleNamespace(tenant=tenant, key=key)
