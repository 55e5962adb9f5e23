"""The worker's grouped stream appends (streams.GroupAppender): the entries of many jobs written in
one round trip, each still fenced by its own attempt. Real Redis."""

from __future__ import annotations

import threading
import time

import pytest

from core.generation.events import Delta, encode
from core.infra import streams
from tests.conftest import wait_for


class _Gated:
    """The real client, whose first pipeline waits on the wire until the test opens the gate: every
    append handed in meanwhile must go out together in the next one."""

    def __init__(self, rds) -> None:
        self.rds, self.gate, self.first = rds, threading.Event(), True

    def pipeline(self, **kw):
        pipe = self.rds.pipeline(**kw)
        if self.first:
            self.first = False
            real = pipe.execute

            def held(**kw2):
                self.gate.wait(10)
                return real(**kw2)

            pipe.execute = held
        return pipe


def test_sixteen_jobs_appends_go_out_in_one_round_trip_each_fenced_alone(rds):
    tag = str(time.time_ns())
    ids = [f"job-grp-{tag}-{i}" for i in range(17)]
    stale = ids[16]
    streams.raise_fence(rds, stale, 2, 60)  # a newer attempt owns this one
    gated = _Gated(rds)
    app = streams.GroupAppender(gated)
    results: dict[str, object] = {}

    def one(job_id: str, attempt: int) -> None:
        payload = encode(Delta(attempt=attempt, choice=0, text=job_id, token_ids=[1]))
        try:
            results[job_id] = app.append(job_id, attempt, [payload], 60, start=1)
        except streams.Fenced as e:
            results[job_id] = e

    first = threading.Thread(target=one, args=(ids[0], 1))
    first.start()
    wait_for(lambda: not gated.first, 10, "the first flush on the wire")  # held there
    rest = [threading.Thread(target=one, args=(j, 1)) for j in ids[1:]]
    for t in rest:
        t.start()
    wait_for(lambda: app._queue.qsize() == 16, 10, "sixteen appends queued")
    gated.gate.set()
    for t in [first, *rest]:
        t.join(10)
    assert app.flushes == 2  # the first alone, then all sixteen others in one pipeline
    assert isinstance(results[stale], streams.Fenced) and streams.entries(rds, stale) == []
    for j in ids[:16]:
        got = results[j]
        assert isinstance(got, list) and len(got) == 1
        assert [e for e, _ in streams.entries(rds, j)] == got


def test_a_redis_error_reaches_every_caller_of_that_flush(rds):
    class Broken:
        def pipeline(self, **kw):
            raise ConnectionError("redis away")

    app = streams.GroupAppender(Broken())
    with pytest.raises(ConnectionError):
        app.append("job-grp-broken", 1, ["{}"], 60, start=1)
