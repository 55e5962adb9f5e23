"""The run_job message Spool pushes itself (core/infra/broker.task_message) is the one Celery's own
`send_task` writes, field for field except the fresh ids, and kombu's Redis transport and Celery's
worker request read it back as the task Spool meant: the worker consumes it through Celery."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import redis as redis_lib
from celery import Celery
from celery.worker.request import Request
from kombu import Connection

from core.infra import broker


def _pushed(rds, queue: str) -> dict:
    raw = rds.rpop(queue)
    assert raw is not None
    return json.loads(raw)


def test_the_message_is_the_one_send_task_writes(it_settings, monkeypatch):
    monkeypatch.setenv("SPOOL_REDIS_URL", it_settings.redis_url)
    from core.config import get_settings

    get_settings.cache_clear()
    broker.celery_app.cache_clear()
    broker._broker.cache_clear()
    try:
        rds = redis_lib.Redis.from_url(get_settings().celery_broker_url)
        queue = broker.queue_for("broker-message-test")
        rds.delete(queue)
        broker.celery_app().send_task(broker.RUN_JOB, args=["job-1", 2], queue=queue, ignore_result=True)
        theirs = _pushed(rds, queue)
        broker.send_run_job("job-1", 2, "broker-message-test")
        ours = _pushed(rds, queue)
        assert rds.llen(queue) == 0
        fresh = {"id", "root_id", "correlation_id", "delivery_tag", "origin", "reply_to"}

        def same(d: dict) -> dict:
            return {k: (same(v) if isinstance(v, dict) else v) for k, v in d.items() if k not in fresh}

        assert same(ours) == same(theirs) | {"body": ours["body"]}
        assert json.loads(base64.b64decode(ours["body"])) == json.loads(base64.b64decode(theirs["body"]))
        assert ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]
        assert broker.queued_jobs(rds, "broker-message-test") == set()
        # The API's async sender pushes the same message.
        sender = broker.AsyncSender(get_settings().celery_broker_url)

        async def push() -> None:
            try:
                await sender([("job-1", 2, "broker-message-test", "interactive", None)])
            finally:
                await sender.aclose()

        asyncio.run(push())
        from_loop = _pushed(rds, queue)
        assert same(from_loop) == same(ours) | {"body": from_loop["body"]}
        assert json.loads(base64.b64decode(from_loop["body"])) == json.loads(base64.b64decode(ours["body"]))
        # A group's messages, pipelined: its jobs split evenly into run_jobs messages of at most
        # `per_message`, one queue's jobs never in another's message, each job in exactly one message.
        sender = broker.AsyncSender(get_settings().celery_broker_url, per_message=8)
        other = broker.queue_for("broker-message-other")
        rds.delete(other)
        group = [(f"job-{i}", 1, "broker-message-test", "interactive", None) for i in range(17)]

        async def push_group() -> None:
            try:
                await sender([*group, ("job-x", 4, "broker-message-other", "interactive", None)])
            finally:
                await sender.aclose()

        asyncio.run(push_group())
        bodies = [json.loads(base64.b64decode(json.loads(m)["body"]))[0] for m in rds.lrange(queue, 0, -1)]
        assert sorted(len(b[0]) for b in bodies) == [5, 6, 6]
        assert {json.loads(m)["headers"]["task"] for m in rds.lrange(queue, 0, -1)} == {broker.RUN_JOBS}
        assert broker.queued_jobs(rds, "broker-message-test") == {(f"job-{i}", 1) for i in range(17)}
        assert broker.queued_jobs(rds, "broker-message-other") == {("job-x", 4)}
        assert json.loads(rds.lindex(other, 0))["headers"]["task"] == broker.RUN_JOB  # a lone job: run_job
        rds.delete(other)
        rds.delete(queue)
        broker.send_run_jobs([("a", 1), ("b", 3)], "broker-message-test")
        assert broker.queued_jobs(rds, "broker-message-test") == {("a", 1), ("b", 3)}
        rds.delete(broker.queue_for("broker-message-test", "batch"))
    finally:
        get_settings.cache_clear()
        broker.celery_app.cache_clear()
        broker._broker.cache_clear()


@pytest.mark.parametrize(
    ("send", "task", "args"),
    [
        (lambda: broker.send_run_job("job-7", 3, "broker-decode-test"), broker.RUN_JOB, ["job-7", 3]),
        (
            lambda: broker.send_run_jobs([("job-8", 1), ("job-9", 2)], "broker-decode-test"),
            broker.RUN_JOBS,
            [[["job-8", 1], ["job-9", 2]]],
        ),
    ],
    ids=["run_job", "run_jobs"],
)
def test_kombu_and_celery_decode_the_message_as_the_task_spool_sent(it_settings, monkeypatch, send, task, args):
    """What a worker does with a message, step by step through the libraries' own code: kombu's Redis
    transport pops and decodes it (envelope, base64 body, the JSON serializer its content type names),
    Celery builds its worker request from it (protocol 2 headers) and runs the task body. A drift of
    the hand-built format (a header renamed, the body's encoding, the [args, kwargs, embed] layout)
    fails here, not in a worker that silently drops the job."""
    monkeypatch.setenv("SPOOL_REDIS_URL", it_settings.redis_url)
    from core.config import get_settings

    get_settings.cache_clear()
    broker._broker.cache_clear()
    url = get_settings().celery_broker_url
    kind = "batch" if task == broker.RUN_JOBS else "interactive"
    queue = broker.queue_for("broker-decode-test", kind)
    redis_lib.Redis.from_url(url).delete(queue)
    app = Celery("decode-test", broker=url, set_as_current=False)
    ran: list[tuple] = []

    @app.task(name=task, shared=False)
    def body(*a):
        ran.append(a)
        return "ran"

    try:
        send()
        with Connection(url) as conn:
            message = conn.default_channel.basic_get(queue, no_ack=True)
            assert message is not None
            assert (message.content_type, message.content_encoding) == ("application/json", "utf-8")
            assert message.decode() == [args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
            request = Request(message, app=app, task=app.tasks[task])
            assert request.task_name == task
            assert request.id == message.headers["id"] == request.root_id == message.properties["correlation_id"]
            assert (request.args, request.kwargs) == (args, {})
            assert request.delivery_info["routing_key"] == queue and request.delivery_info["exchange"] == ""
            assert request.delivery_info["priority"] == 0 and not request.delivery_info["redelivered"]
            assert (request.eta, request.expires, request.parent_id, request.group) == (None, None, None, None)
            assert request.ignore_result and message.headers["retries"] == 0
            assert request.execute() == "ran"
            assert ran == [tuple(args)]
    finally:
        redis_lib.Redis.from_url(url).delete(queue)
        get_settings.cache_clear()
        broker._broker.cache_clear()
