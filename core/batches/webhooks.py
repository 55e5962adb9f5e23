"""Batch completion webhooks: signed, delivered by the dispatcher, retried with backoff.

Signature (Stripe-style): header `x-spool-signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of
"<t>.<body>" with SPOOL_WEBHOOK_SECRET>`. Receivers recompute it and reject stale timestamps.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from datetime import UTC, datetime, timedelta

import httpx
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from core.batches.progress import batch_json
from core.batches.status import FINAL
from core.infra.orm import Batch

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 10


def sign(secret: str, body: bytes, ts: int | None = None) -> str:
    ts = int(time.time()) if ts is None else ts
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={ts},v1={mac}"


def verify(secret: str, body: bytes, header: str, tolerance_s: int = 300) -> bool:
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        ts = int(parts["t"])
    except (KeyError, ValueError):
        return False
    expected = sign(secret, body, ts).split("v1=")[1]
    return abs(time.time() - ts) <= tolerance_s and hmac.compare_digest(expected, parts.get("v1", ""))


def backoff_s(attempts: int, base: float) -> float:
    return min(base * 2 ** (attempts - 1), 3600.0)


def deliver_due(session: Session, secret: str | None, base_s: float, limit: int = 5) -> int:
    """POST the final state of ended batches whose webhook is due. Returns deliveries made."""
    if not secret:
        return 0
    now = datetime.now(UTC)
    due = session.scalars(
        select(Batch)
        .where(
            Batch.status.in_([s.value for s in FINAL]),
            Batch.webhook_url.isnot(None),
            # Never tried, or a retry is due. Delivered or abandoned states carry no next_at.
            or_(
                Batch.webhook_state.is_(None), Batch.webhook_state["next_at"].astext.cast(Batch.created_at.type) <= now
            ),
        )
        .order_by(Batch.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    delivered = 0
    for b in due:
        state = dict(b.webhook_state or {"attempts": 0})
        state.pop("next_at", None)
        body = json.dumps({"object": "event", "type": f"batch.{b.status}", "data": batch_json(b)}).encode()
        state["attempts"] = state.get("attempts", 0) + 1
        try:
            r = httpx.post(
                b.webhook_url or "",
                content=body,
                timeout=5.0,
                headers={
                    "content-type": "application/json",
                    "x-spool-signature": sign(secret, body),
                    "x-spool-event-id": f"{b.id}:{b.status}",
                },
            )
            ok = 200 <= r.status_code < 300
            state["last_status"] = r.status_code
        except httpx.HTTPError as exc:
            ok = False
            state["last_error"] = repr(exc)[:200]
        if ok:
            state["delivered"] = now.isoformat()
            delivered += 1
        elif state["attempts"] >= MAX_ATTEMPTS:
            state["gave_up"] = now.isoformat()
            log.warning("webhook for %s given up after %d attempts", b.id, state["attempts"])
        else:
            state["next_at"] = (now + timedelta(seconds=backoff_s(state["attempts"], base_s))).isoformat()
        b.webhook_state = state
    session.commit()
    return delivered
