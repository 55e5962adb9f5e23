"""A webhook delivery's attempt is counted when it is claimed, not when its task reports back: a
receiver that holds every delivery past its lease (or a task that is lost) used to be re-sent every
lease, for ever, each time on another thread, with `attempts` never moving."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from core.batches import webhooks
from core.infra.orm import Batch
from core.states import BatchStatus
from ops import factories


def test_claims_count_attempts_and_end_in_giving_up(session):
    t = factories.tenant(session)
    b = factories.batch(session, t, status=BatchStatus.completed, webhook_url="http://127.0.0.1:9/hook")
    now = datetime.now(UTC)
    for n in range(1, webhooks.MAX_ATTEMPTS + 1):
        claimed = [x for x in webhooks.claim_due(session, lease_s=60) if x.tenant_id == t.id]
        assert [x.id for x in claimed] == [b.id]
        session.refresh(b)
        assert b.webhook_state["attempts"] == n
        # Its task never reports back; the lease lapses.
        b.webhook_state = {**b.webhook_state, "next_at": (now - timedelta(seconds=1)).isoformat()}
        session.commit()
    assert [x for x in webhooks.claim_due(session, lease_s=60) if x.tenant_id == t.id] == []  # no eleventh send
    session.refresh(b)
    assert b.webhook_state["attempts"] == webhooks.MAX_ATTEMPTS + 1 and "gave_up" in b.webhook_state
    assert [x for x in webhooks.claim_due(session, lease_s=60) if x.tenant_id == t.id] == []


def test_deliveries_leave_from_their_own_pool_capped_per_tenant(session, sessions, it_settings):
    """The Celery task only hands over (it returns while the receiver still holds the delivery), one
    tenant has at most `per_tenant` deliveries in flight (the next is deferred, its attempt given
    back), and a receiver dripping its headers is cut at the deadline."""
    import socket
    import threading
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    holding, release = threading.Event(), threading.Event()

    def drip() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        holding.set()
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 500:
            if release.is_set():
                break
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                break  # cut by the client at its deadline
            time.sleep(0.5)
        conn.close()

    threading.Thread(target=drip, daemon=True).start()
    settings = it_settings.model_copy(
        update={"webhook_allow": "127.0.0.1/32", "webhook_timeout_s": 2.0, "webhook_retry_s": 0.5}
    )
    t = factories.tenant(session)
    hook = f"http://127.0.0.1:{srv.getsockname()[1]}/hook"
    ids = [factories.batch(session, t, status=BatchStatus.completed, webhook_url=hook).id for _ in range(2)]
    assert len([b for b in webhooks.claim_due(session, lease_s=60) if b.tenant_id == t.id]) == 2
    pool = webhooks.Pool(threads=2, per_tenant=1)
    try:
        assert pool.submit(sessions, ids[0], "{}", settings) == "handed over"
        assert holding.wait(30)  # the receiver holds the delivery; the task has long returned
        assert pool.submit(sessions, ids[1], "{}", settings) == "deferred"
        session.expire_all()
        assert session.get(Batch, ids[1]).webhook_state["attempts"] == 0  # given back untried
        pool._exec.shutdown(wait=True)  # the held delivery ends at its deadline, not with the drip
        session.expire_all()
        state = session.get(Batch, ids[0]).webhook_state
        assert state["attempts"] == 1 and state["last_error"] == "no answer within 2 s", state
    finally:
        release.set()
        srv.close()


def test_a_deferred_delivery_is_no_longer_in_flight(session, sessions, it_settings):
    """A delivery the pool defers gives its claim back: the tenant's room opens again at once."""
    t = factories.tenant(session)
    ids = [
        factories.batch(session, t, status=BatchStatus.completed, webhook_url="http://127.0.0.1:9/hook").id
        for _ in range(3)
    ]
    first = [b.id for b in webhooks.claim_due(session, lease_s=60) if b.tenant_id == t.id]
    assert len(first) == webhooks.PER_TENANT_IN_FLIGHT
    webhooks._defer(sessions, first[0], delay_s=60)  # due again in a minute, and no longer leased
    session.expire_all()
    assert "lease" not in session.get(Batch, first[0]).webhook_state
    more = [b.id for b in webhooks.claim_due(session, lease_s=60) if b.tenant_id == t.id]
    assert more == [next(i for i in ids if i not in first)]


def test_an_idn_webhook_host_is_a_failed_attempt_never_an_exception(session, sessions, it_settings, monkeypatch):
    """Before: a non-ASCII host that resolved (here: to an allowed address) went on to httpx, whose
    ASCII-only headers raised UnicodeEncodeError out of `deliver`: no attempt recorded, re-sent at
    every lease. Now it is refused like any address Spool will not call, and backs off."""
    import socket

    real = socket.getaddrinfo

    def resolves(host, *a, **k):
        return real("127.0.0.1" if host == "bücher.example" else host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", resolves)
    settings = it_settings.model_copy(update={"webhook_allow": "127.0.0.1/32", "webhook_timeout_s": 2.0})
    t = factories.tenant(session)
    b = factories.batch(session, t, status=BatchStatus.completed, webhook_url="http://bücher.example:9/hook")
    assert [x.id for x in webhooks.claim_due(session, lease_s=60) if x.tenant_id == t.id] == [b.id]
    assert webhooks.deliver(sessions, b.id, "{}", settings) == "retry"
    session.expire_all()
    state = session.get(Batch, b.id).webhook_state
    assert state["attempts"] == 1 and "punycode" in state["last_error"] and "lease" not in state, state
