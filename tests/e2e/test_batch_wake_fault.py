"""POST /v1/batches stores the batch, then wakes a validator through Redis. If Redis is away for that
wake-up, the batch is stored all the same: the answer must be the batch (the validator finds it at
its next poll), never a 503 that makes the `openai` SDK retry and create a second batch.

The fault is real and on the wire: an API replica reaches Redis through a proxy that cuts every
connection on which the wake-up's LPUSH arrives (redis-py's retries included), while everything
else (authentication, limits) passes. Nothing of Spool's is mocked."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import openai
import pytest

from core.infra.redis_keys import BATCH_VALIDATE_WAKE
from tests.conftest import MODEL, TEST_REDIS, wait_for
from tests.helpers import api_replica, batch_file, close, pipe, tcp_proxy, tenant_rows


@contextmanager
def redis_cut_on_wake(redis_url: str) -> Iterator[tuple[str, list[int]]]:
    """A TCP proxy to Redis that drops a connection (both ways, no reply) as soon as the client sends
    an LPUSH to the batch wake-up list on it. Yields (the proxied Redis URL, [connections cut])."""
    target = urlsplit(redis_url)
    cut = [0]
    wake = BATCH_VALIDATE_WAKE.encode()

    def client_to_upstream(client: socket.socket, up: socket.socket) -> None:
        tail = b""
        try:
            while data := client.recv(65536):
                seen = tail + data
                if b"LPUSH" in seen.upper() and wake in seen:
                    cut[0] += 1
                    break  # Redis "went away" with this command unanswered
                up.sendall(data)
                tail = seen[-512:]
        except OSError:
            pass
        finally:
            close(client, up)

    with tcp_proxy(target.hostname or "127.0.0.1", target.port or 6379, lambda _n: (client_to_upstream, pipe)) as port:
        yield f"redis://127.0.0.1:{port}{target.path}", cut


@pytest.fixture(scope="module")
def api_with_redis_cut_on_wake(stack) -> Iterator[tuple[str, list[int]]]:
    with redis_cut_on_wake(TEST_REDIS) as (url, cut):
        base, proc = api_replica(stack, "api-wakecut", SPOOL_REDIS_URL=url)
        try:
            yield base, cut
        finally:
            proc.terminate()
            proc.wait(15)


def _batches_of(db, tenant: str) -> list[str]:
    return [r["id"] for r in tenant_rows(db, tenant, "batches", "x.id")]


def test_a_batch_stored_while_redis_is_away_for_its_wake_up_is_answered_once(stack, db, api_with_redis_cut_on_wake):
    base, cut = api_with_redis_cut_on_wake
    key = stack.new_tenant("wake-cut")
    direct = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
    line = batch_file("/v1/completions", {"a": {"model": MODEL, "prompt": "Hi"}})
    f = direct.files.create(file=("w.jsonl", io.BytesIO(line)), purpose="batch")

    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=2, timeout=60)
    try:
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    except openai.APIStatusError as exc:
        stored = len(_batches_of(db, "wake-cut"))
        pytest.fail(f"answered {exc.status_code} after storing {stored} batches for one create")

    assert cut[0] >= 1  # the wake-up really met a Redis that was away
    assert _batches_of(db, "wake-cut") == [b.id]  # one batch: the SDK had no reason to retry
    # Nobody was woken, and the batch is validated and run all the same (the validator's poll).
    done = wait_for(
        lambda: (x := direct.batches.retrieve(b.id)).status in ("completed", "failed", "expired") and x,
        120,
        "the batch to finish",
    )
    assert done.status == "completed" and done.request_counts.completed == 1
