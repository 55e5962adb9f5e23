"""The worker's grouped stream appends (write.append_many, write.GroupAppender): the entries of
many jobs written by one script call, each still fenced by its own attempt. Real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis as redis_lib

from core.generation.events import Delta, encode
from core.infra.streams import keys, write
from tests.conftest import wait_for


def _delta(text: str, attempt: int = 1) -> str:
    return encode(Delta(attempt=attempt, choice=0, text=text, token_ids=[1]))


class _Gated:
    """The real client, whose first script call waits on the wire until the test opens the gate:
    every append handed in meanwhile must go out together in the next one."""

    def __init__(self, rds) -> None:
        self.rds, self.gate, self.first, self.calls = rds, threading.Event(), True, 0

    def evalsha(self, *args):
        self.calls += 1
        if self.first:
            self.first = False
            self.gate.wait(10)
        return self.rds.evalsha(*args)

    def eval(self, *args):
        return self.rds.eval(*args)


def test_sixteen_jobs_appends_go_out_in_one_script_call_each_fenced_alone(rds):
    tag = str(time.time_ns())
    ids = [f"job-grp-{tag}-{i}" for i in range(17)]
    stale = ids[16]
    write.raise_fence(rds, stale, 2, 60)  # a newer attempt owns this one
    gated = _Gated(rds)
    app = write.GroupAppender(gated)
    results: dict[str, object] = {}

    def one(job_id: str, attempt: int) -> None:
        try:
            results[job_id] = app.append(job_id, attempt, [_delta(job_id, attempt)], 60, start=1)
        except write.Fenced as e:
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
    assert app.flushes == 2 and gated.calls == 2  # the first alone, then all sixteen others in one call
    assert isinstance(results[stale], write.Fenced) and write.entries(rds, stale) == []
    for j in ids[:16]:
        got = results[j]
        assert isinstance(got, list) and len(got) == 1
        assert [e for e, _ in write.entries(rds, j)] == got


def test_a_redis_error_reaches_every_caller_of_that_flush(rds):
    class Broken:
        def evalsha(self, *args):
            raise redis_lib.ConnectionError("redis away")

    app = write.GroupAppender(Broken())
    with pytest.raises(redis_lib.ConnectionError):
        app.append("job-grp-broken", 1, ["{}"], 60, start=1)


def test_a_blocked_reader_finds_a_whole_step_when_it_wakes(rds):
    """Why one call: a step's appends as one script are atomic, so the API's shared read, woken by
    the first of them, finds every job's entries there in its next read: two XREADs per step instead
    of one per job or so (Redis 7.0 answers a woken XREAD with the first ready stream alone)."""
    tag = str(time.time_ns())
    ids = [f"job-wake-{tag}-{i}" for i in range(16)]
    wanted = {keys.stream_key(j): "0-0" for j in ids}
    reader = redis_lib.Redis(connection_pool=rds.connection_pool)
    got: list = []
    t = threading.Thread(target=lambda: got.append(reader.xread(wanted, block=10_000)))
    t.start()
    wait_for(lambda: int(rds.info("clients")["blocked_clients"]) >= 1, 10, "the reader blocked")
    answers = write.append_many(rds, [write.Append(j, 1, [_delta(j), _delta(j + "!")], 60, 1) for j in ids])
    t.join(10)
    assert answers == [["0-1", "0-2"]] * 16
    assert got and got[0], "the reader was woken by the appends"
    then = reader.xread(wanted)  # at once, not blocking: the rest of the step is all there
    found = {k.decode(): [e[0].decode() for e in entries] for k, entries in then}
    assert found == {keys.stream_key(j): ["0-1", "0-2"] for j in ids}


def test_a_retried_call_writes_nothing_twice_and_a_lost_stream_is_told_apart(rds):
    tag = str(time.time_ns())
    a, b = f"job-many-{tag}-a", f"job-many-{tag}-b"
    x, y, z, q = (_delta(t) for t in "xyzq")
    first = [write.Append(a, 1, [x, y], 60, 1)]
    assert write.append_many(rds, first) == [["0-1", "0-2"]]
    # the same call again (its answer was lost), plus one more entry, and a job whose stream is gone
    again = [write.Append(a, 1, [x, y, z], 60, 1), write.Append(b, 1, [q], 60, 4)]
    assert write.append_many(rds, again) == [["0-1", "0-2", "0-3"], write.LOST]
    assert [p for _, p in write.entries(rds, a)] == [x, y, z]
    assert not rds.exists(keys.stream_key(b))


def test_a_key_of_another_type_fails_its_own_job_alone(rds):
    tag = str(time.time_ns())
    ids = [f"job-iso-{tag}-{i}" for i in range(3)]
    rds.set(keys.stream_key(ids[1]), "not a stream")  # written by hand
    payloads = {j: _delta(j) for j in ids}
    answers = write.append_many(rds, [write.Append(j, 1, [payloads[j]], 60, 1) for j in ids])
    assert answers[0] == ["0-1"] and answers[2] == ["0-1"]
    assert isinstance(answers[1], redis_lib.ResponseError) and "WRONGTYPE" in str(answers[1])
    with pytest.raises(redis_lib.ResponseError):
        write.appended(answers[1], ids[1], 1)
    assert rds.get(keys.stream_key(ids[1])) == b"not a stream"
    assert [p for _, p in write.entries(rds, ids[2])] == [payloads[ids[2]]]


def test_the_script_is_loaded_again_after_redis_forgets_it(rds):
    rds.script_flush()
    job = f"job-flush-{time.time_ns()}"
    assert write.append_fenced(rds, job, 1, [_delta("a")], 60, start=1) == ["0-1"]
    assert rds.script_exists(write._APPEND.sha) == [True]
