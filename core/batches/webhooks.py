"""Batch webhooks: the ledger decides when, a Celery task delivers (never the dispatcher loop).

- The dispatcher only *schedules*: `claim_due` stamps each due delivery with a lease (`next_at` and
  `lease` in the future) and the caller sends one `spool.deliver_webhook` task per batch. A lost
  message or a worker killed mid-delivery costs one lease; a slow receiver holds one worker thread
  for at most `SPOOL_WEBHOOK_TIMEOUT_S`, never dispatching or crash recovery.
- Claiming is fair across tenants: at most `PER_TENANT_IN_FLIGHT` deliveries of one tenant are leased
  at once, and every tenant's oldest due delivery is claimed before any tenant's next, so one tenant
  with hundreds of ended batches and a slow receiver never keeps another tenant's webhook waiting.
- `deliver` makes one attempt: the address guard (loopback, private, link-local, metadata and other
  non-global addresses refused unless `SPOOL_WEBHOOK_ALLOW` lists them) on the *resolved* address,
  which is then the one connected to (no second lookup to rebind); no redirects; one deadline for the
  whole exchange, the DNS lookup included. Hosts are ASCII (an internationalized name is given in
  its punycode `xn--` form). Failures back off (doubling, 10 tries).
- Signatures follow Standard Webhooks (`webhook-id`, `webhook-timestamp`, `webhook-signature`), so a
  receiver verifies with off-the-shelf code; each tenant has its own `whsec_` secret.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import ColumnElement, Exists, and_, exists, func, or_, select, text, update
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from core.config import Settings
from core.infra.orm import Batch, Tenant
from core.states import FINAL

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 10
MAX_RESPONSE_BYTES = 64 * 1024  # what a receiver's answer may cost us to read
# Deliveries of one tenant leased at once (claim_due) and running at once in one process (Pool).
PER_TENANT_IN_FLIGHT = 2
CLAIM_LIMIT = 200  # deliveries one claim hands out, all tenants together (in fair order)


class RefusedAddress(ValueError):
    """The webhook URL is not one Spool will call (scheme, userinfo, or a non-global address)."""


# -- secrets -----------------------------------------------------------------------------------
def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_for(session: Session, tenant_id: int, *, rotate: bool = False) -> str:
    """The tenant's signing secret, made on first use (or replaced when rotating)."""
    t = session.get(Tenant, tenant_id, with_for_update=True)
    assert t is not None
    if rotate or not t.webhook_secret:
        t.webhook_secret = new_secret()
        session.commit()
    return t.webhook_secret


def tenant_secret(sessions: sessionmaker[Session], tenant_id: int, *, rotate: bool = False) -> str:
    with sessions() as s:
        return secret_for(s, tenant_id, rotate=rotate)


def sign(secret: str, msg_id: str, body: bytes, at: datetime | None = None) -> dict[str, str]:
    at = at or datetime.now(UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, at, body.decode()),
    }


def verify(secret: str, body: bytes, headers: dict[str, str]) -> bool:
    """What a receiver does (tests and docs): Standard Webhooks' own verifier."""
    try:
        Webhook(secret).verify(body, headers)
        return True
    except Exception:
        return False


# -- the address guard ---------------------------------------------------------------------------
# IPv6 ranges that carry an IPv4 address in their low 32 bits (NAT64 RFC 6052/8215, SIIT's
# IPv4-translated ::ffff:0:a.b.c.d, the deprecated IPv4-compatible ::a.b.c.d): a gateway may deliver
# to that IPv4 address, so it is the one judged.
_EMBEDS_V4_LOW32 = [ipaddress.ip_network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "::ffff:0:0:0/96", "::/96")]


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address can lead to (mapped, 6to4, Teredo, NAT64/SIIT, compatible)."""
    out: list[ipaddress.IPv4Address] = []
    if ip.ipv4_mapped is not None:
        out.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        out.append(ip.sixtofour)
    if ip.teredo is not None:
        out += list(ip.teredo)
    if any(ip in net for net in _EMBEDS_V4_LOW32) and int(ip) > 1:  # not :: or ::1 (judged as themselves)
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def _in_allow(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow: list[str]) -> bool:
    for entry in allow:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow: list[str]) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner:  # every IPv4 address it can reach must pass on its own
            return all(_allowed(v4, allow) for v4 in inner)
    if _in_allow(ip, allow):
        return True
    return ip.is_global and not ip.is_multicast


def resolve(url: str, allow: list[str]) -> tuple[str, str]:
    """(host, address to connect to) for a URL Spool may call; RefusedAddress otherwise. Every
    address the name resolves to must pass, so a name that mixes public and private ones is refused."""
    try:  # urlsplit and .port raise ValueError on "http://[::1/" or a port out of range
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RefusedAddress("webhook_url is not a valid URL (host or port).") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RefusedAddress("webhook_url must be an http(s) URL with a host.")
    if parts.username or parts.password:
        raise RefusedAddress("webhook_url may not carry credentials.")
    if not parts.netloc.isascii():
        # IDNA 2003 (Python's codec) and 2008 (browsers) map some names differently, and httpx sends
        # ASCII headers only: the client says which name it means, in its punycode form.
        raise RefusedAddress(
            "webhook_url's host must be ASCII: give an internationalized domain name in its punycode form (xn--...)."
        )
    host = parts.hostname
    if host in allow:
        return host, host
    try:
        infos = socket.getaddrinfo(host, port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise RefusedAddress(f"webhook_url's host '{host[:100]}' does not resolve.") from exc
    addrs = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for ip in addrs:
        if not _allowed(ip, allow):
            raise RefusedAddress(
                f"webhook_url's host '{host}' is a loopback, private, link-local or otherwise non-public "
                "address; an operator may allow it with SPOOL_WEBHOOK_ALLOW."
            )
    return host, str(addrs[0])


def check_url(url: str, settings: Settings) -> None:
    """At submit time: a literal address or a name that resolves to a refused one is a 400 then,
    not a silent failure later. (Delivery checks again: names can change.)"""
    resolve(url, settings.webhook_allow_list)


# -- scheduling (dispatcher) and delivery (Celery task) --------------------------------------------
def backoff_s(attempts: int, base: float) -> float:
    return min(base * 2 ** (attempts - 1), 3600.0)


def _with_webhook() -> ColumnElement[bool]:
    return and_(Batch.status.in_([s.value for s in FINAL]), Batch.webhook_url.isnot(None))


def _is_due(now: datetime) -> ColumnElement[bool]:
    """Never tried, or a retry (or a lapsed lease) is due. Delivered or abandoned: no next_at."""
    next_at = Batch.webhook_state["next_at"].astext.cast(Batch.created_at.type)
    return and_(_with_webhook(), or_(Batch.webhook_state.is_(None), next_at <= now))


def any_pending() -> Exists:
    """Some ended batch's webhook is not yet delivered or abandoned (never tried, leased, or a retry
    waiting): `claim_due` may have something to claim now or later."""
    return exists().where(_with_webhook(), or_(Batch.webhook_state.is_(None), Batch.webhook_state.has_key("next_at")))


def _in_flight(now: datetime) -> ColumnElement[bool]:
    """Claimed, neither reported back (`deliver` drops the lease) nor past its lease."""
    lease = Batch.webhook_state["lease"].astext.cast(Batch.created_at.type)
    next_at = Batch.webhook_state["next_at"].astext.cast(Batch.created_at.type)
    return and_(_with_webhook(), lease > now, next_at > now)


def claim_due(
    session: Session, lease_s: float, limit: int = CLAIM_LIMIT, per_tenant: int = PER_TENANT_IN_FLIGHT
) -> list[Batch]:
    """Ended batches whose webhook is due, each leased for `lease_s` so that a lost task is re-sent
    once the lease passes and a delivered one is never sent twice at once. The caller renders each
    batch's final state into the task (workers never render the wire protocol).

    Fair across tenants: a tenant gets at most `per_tenant` deliveries in flight (those leased and
    not yet reported count), and the claim takes every tenant's oldest due delivery before any
    tenant's second, so a tenant with hundreds due (and a slow receiver) never holds another's back.
    Claims are serialized (a transaction-scoped advisory lock): two dispatchers never both fill a
    tenant's room."""
    now = datetime.now(UTC)
    session.execute(text("SELECT pg_advisory_xact_lock(hashtext('spool:webhook-claim'))"))
    flying: dict[int, int] = {
        tenant_id: n
        for tenant_id, n in session.execute(
            select(Batch.tenant_id, func.count()).where(_in_flight(now)).group_by(Batch.tenant_id)
        ).all()
    }
    rank = func.row_number().over(partition_by=Batch.tenant_id, order_by=(Batch.created_at, Batch.id))
    ranked = select(Batch.id, Batch.tenant_id, rank.label("rank")).where(_is_due(now)).subquery()
    candidates = session.execute(
        select(ranked.c.id, ranked.c.tenant_id)
        .where(ranked.c.rank <= per_tenant)
        .order_by(ranked.c.rank, ranked.c.tenant_id)  # each tenant's first, then each one's second
    ).all()
    room: dict[int, int] = {}
    order: dict[str, int] = {}
    for batch_id, tenant_id in candidates:
        left = room.setdefault(tenant_id, per_tenant - flying.get(tenant_id, 0))
        if left <= 0:
            continue
        room[tenant_id] = left - 1
        order[batch_id] = len(order)
        if len(order) >= limit:
            break
    if not order:
        session.commit()
        return []
    # Locked and checked again: a delivery reported back or claimed meanwhile is not taken twice.
    due = sorted(
        session.scalars(
            select(Batch).where(Batch.id.in_(list(order)), _is_due(now)).with_for_update(skip_locked=True)
        ).all(),
        key=lambda b: order[b.id],
    )
    sent = []
    for b in due:
        # The attempt is counted here, when it is claimed: a delivery whose task never reports back
        # (a receiver that holds it past the lease, a lost task) still uses one up, so re-sends end.
        state = dict(b.webhook_state or {})
        state["attempts"] = state.get("attempts", 0) + 1
        if state["attempts"] > MAX_ATTEMPTS:
            state.pop("next_at", None)
            state["gave_up"] = now.isoformat()
            log.warning("webhook for %s given up after %d attempts", b.id, MAX_ATTEMPTS)
        else:
            state["next_at"] = state["lease"] = (now + timedelta(seconds=lease_s)).isoformat()
            sent.append(b)
        b.webhook_state = state
    session.commit()
    return sent


# DNS lookups of deliveries: the system resolver has no deadline of its own, so a lookup runs here and
# the delivery waits for it only until its deadline. A hung lookup still holds its thread until the
# resolver gives up, so one tenant has at most DNS_PER_TENANT lookups in flight (hung ones included):
# its receivers' names cannot take the threads every other tenant's deliveries resolve on.
_DNS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="webhook-dns")
DNS_PER_TENANT = 2
_dns_busy: dict[int, int] = {}
_dns_lock = threading.Lock()


def _lookup(url: str, settings: Settings, tenant_id: int) -> Future[tuple[str, str]]:
    with _dns_lock:
        if _dns_busy.get(tenant_id, 0) >= DNS_PER_TENANT:
            raise TimeoutError  # this tenant's earlier lookups have not ended: a failed attempt, retried later
        _dns_busy[tenant_id] = _dns_busy.get(tenant_id, 0) + 1

    def done(_: Future[tuple[str, str]]) -> None:
        with _dns_lock:
            _dns_busy[tenant_id] -= 1
            if not _dns_busy[tenant_id]:
                del _dns_busy[tenant_id]

    lookup = _DNS.submit(resolve, url, settings.webhook_allow_list)
    lookup.add_done_callback(done)
    return lookup


def _post(url: str, body: bytes, headers: dict[str, str], settings: Settings, tenant_id: int = 0) -> int:
    """One POST to the guarded address, no redirects, within one deadline for the whole exchange,
    the DNS lookup included (TimeoutError past it, or at once while the tenant has DNS_PER_TENANT
    lookups unfinished)."""
    limit = settings.webhook_timeout_s
    deadline = time.monotonic() + limit
    lookup = _lookup(url, settings, tenant_id)
    try:
        host, addr = lookup.result(timeout=limit)
    except TimeoutError:  # concurrent.futures' TimeoutError is the builtin one (3.11+)
        lookup.cancel()
        raise
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return asyncio.run(_post_pinned(url, host, addr, body, headers, left))


async def _post_pinned(url: str, host: str, addr: str, body: bytes, headers: dict[str, str], limit: float) -> int:
    # httpx's timeouts are per network operation: a receiver that drips its status line or headers one
    # byte at a time would hold this thread for ever. One asyncio deadline covers connect, headers and body.
    parts = urlsplit(url)
    netloc = (f"[{addr}]" if ":" in addr else addr) + (f":{parts.port}" if parts.port else "")
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    timeout = httpx.Timeout(limit, connect=min(5.0, limit))
    ext = {"sni_hostname": host} if parts.scheme == "https" else {}
    status: int | None = None
    try:
        async with (
            asyncio.timeout(limit),
            httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client,
            client.stream(
                "POST",
                pinned,
                content=body,
                headers={**headers, "host": parts.netloc.rsplit("@", 1)[-1]},
                extensions=ext,
            ) as r,
        ):
            status = r.status_code
            read = 0
            async for chunk in r.aiter_raw():  # the answer's body is read only to free the connection
                read += len(chunk)
                if read > MAX_RESPONSE_BYTES:
                    break
    except TimeoutError:
        if status is None:
            raise  # no status within the deadline: a failed attempt
    assert status is not None
    return status


def event_body(status: str, batch: dict) -> str:
    """The delivered JSON: the batch object (rendered by the caller, core/protocol/render.py) in
    Standard Webhooks' event envelope. Built here, not in render: the webhook task runs in the worker,
    and workers never import core.protocol (tests/unit/test_homes.py knows this home)."""
    return json.dumps({"type": f"batch.{status}", "timestamp": datetime.now(UTC).isoformat(), "data": batch})


def deliver(sessions: sessionmaker[Session], batch_id: str, body: str, settings: Settings) -> str:
    """One delivery attempt of a batch's final state; records the outcome and returns it."""
    with sessions() as s:
        b = s.get(Batch, batch_id)
        if b is None or b.webhook_url is None or (b.webhook_state or {}).get("next_at") is None:
            return "nothing"  # delivered, abandoned, or deleted meanwhile
        secret, tenant_id = secret_for(s, b.tenant_id), b.tenant_id
        state = {k: v for k, v in (b.webhook_state or {}).items() if k not in ("next_at", "lease", "last_error")}
        msg_id, url, rid = f"msg_{batch_id}_{b.status}", b.webhook_url, b.request_id
    state["attempts"] = max(1, state.get("attempts", 0))  # counted by claim_due
    ok = False
    headers = {"content-type": "application/json", **sign(secret, msg_id, body.encode())}
    if rid:
        headers["x-request-id"] = rid  # the request that created the batch
    try:
        code = _post(url, body.encode(), headers, settings, tenant_id)
        state["last_status"] = code
        ok = 200 <= code < 300
    except RefusedAddress as exc:
        state["last_error"] = str(exc)
    except httpx.HTTPError as exc:
        state["last_error"] = type(exc).__name__
    except TimeoutError:
        state["last_error"] = f"no answer within {settings.webhook_timeout_s:g} s"
    except Exception as exc:  # anything else one attempt meets is a failed attempt, never a lost delivery
        log.warning("webhook for %s: attempt failed (%s)", batch_id, type(exc).__name__, exc_info=True)
        state["last_error"] = type(exc).__name__
    now = datetime.now(UTC)
    if ok:
        state["delivered"] = now.isoformat()
        outcome = "delivered"
    elif state["attempts"] >= MAX_ATTEMPTS:
        state["gave_up"] = now.isoformat()
        outcome = "gave_up"
        log.warning("webhook for %s given up after %d attempts", batch_id, state["attempts"])
    else:
        state["next_at"] = (now + timedelta(seconds=backoff_s(state["attempts"], settings.webhook_retry_s))).isoformat()
        outcome = "retry"
    with sessions() as s:
        s.execute(update(Batch).where(Batch.id == batch_id).values(webhook_state=state))
        s.commit()
    return outcome


class Pool:
    """Deliveries run here, on a few threads of their own, never on the Celery thread that received
    the task (in the worker, those are the inference threads): the task hands over and returns. At
    most `per_tenant` deliveries of one tenant are in flight in this process; one more is deferred
    (its claim and its attempt given back), so one tenant's slow receivers cannot take every thread."""

    def __init__(self, threads: int = 4, per_tenant: int = PER_TENANT_IN_FLIGHT) -> None:
        self._exec = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="webhook")
        self._lock = threading.Lock()
        self._flight: dict[int, int] = {}
        self.per_tenant = per_tenant

    def submit(self, sessions: sessionmaker[Session], batch_id: str, body: str, settings: Settings) -> str:
        with sessions() as s:
            tenant_id = s.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))
        if tenant_id is None:
            return "nothing"
        with self._lock:
            if self._flight.get(tenant_id, 0) >= self.per_tenant:
                busy = True
            else:
                busy = False
                self._flight[tenant_id] = self._flight.get(tenant_id, 0) + 1
        if busy:
            _defer(sessions, batch_id, settings.webhook_retry_s)
            return "deferred"
        self._exec.submit(self._run, tenant_id, sessions, batch_id, body, settings)
        return "handed over"

    def _run(
        self, tenant_id: int, sessions: sessionmaker[Session], batch_id: str, body: str, settings: Settings
    ) -> None:
        try:
            deliver(sessions, batch_id, body, settings)
        except Exception:
            log.exception("webhook delivery for %s failed; its lease lapses and it is claimed again", batch_id)
        finally:
            with self._lock:
                self._flight[tenant_id] -= 1


def _defer(sessions: sessionmaker[Session], batch_id: str, delay_s: float) -> None:
    """Give a claimed delivery back untried: its attempt uncounted, due again shortly."""
    with sessions() as s:
        b = s.get(Batch, batch_id, with_for_update=True)
        if b is not None and b.webhook_state and b.webhook_state.get("next_at"):
            due = datetime.now(UTC) + timedelta(seconds=max(delay_s, 0.5))
            attempts = max(0, b.webhook_state.get("attempts", 1) - 1)
            state = {k: v for k, v in b.webhook_state.items() if k != "lease"}  # no longer in flight
            b.webhook_state = {**state, "attempts": attempts, "next_at": due.isoformat()}
            s.commit()
