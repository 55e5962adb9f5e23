"""The batch validator under a Redis that refuses it something (not an outage): found by the cluster
harness, whose first Redis ran in protected mode and answered every client on another host `DENIED`.
The validator's wait raised a ResponseError, which its loop took for a poison batch with no batch,
and it spun: thousands of tracebacks a second on the dispatcher's host. Here the refusal is real: an
ACL user of the test's Redis that may not run BLPOP."""

from __future__ import annotations

import logging
import threading
import uuid

import redis as redis_lib

from core.batches.ingest import run_validator
from tests.integration.conftest import IT_REDIS


def test_a_redis_refusal_outside_any_batch_waits_instead_of_spinning(sessions, it_settings, caplog):
    admin = redis_lib.Redis.from_url(IT_REDIS)
    user = f"spool-no-blpop-{uuid.uuid4().hex[:8]}"
    admin.execute_command("ACL", "SETUSER", user, "on", "nopass", "~*", "&*", "+@all", "-blpop")
    host, db = IT_REDIS.removeprefix("redis://").rsplit("/", 1)
    refused = redis_lib.Redis.from_url(f"redis://{user}@{host}/{db}")
    stop = threading.Event()
    validator = threading.Thread(
        target=run_validator, args=(sessions, refused, it_settings), kwargs={"poll_s": 0.5, "stop": stop}
    )
    try:
        with caplog.at_level(logging.ERROR, logger="core.batches.ingest"):
            validator.start()
            stop.wait(2.0)
            stop.set()
            validator.join(10)
        assert not validator.is_alive()
        errors = [r for r in caplog.records if r.name == "core.batches.ingest" and r.levelno >= logging.ERROR]
        assert errors, "the refusal was never met"  # the wait really was refused
        assert "NoPermissionError" in (errors[0].exc_text or ""), errors[0].exc_text
        assert len(errors) <= 6, f"{len(errors)} errors in 2 s: the loop spins"  # one per 0.5 s wait
        assert not any("failing the batch" in r.getMessage() for r in errors)
    finally:
        stop.set()
        refused.close()
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()
