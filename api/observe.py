"""Request identity and the access log: every response carries `x-request-id` (the client's, when it
sent a sane one, else a new one); the id is bound to every log line of the request, stored on the
jobs and batches it creates, and carried into worker logs and webhook deliveries. One JSON access
line per request: method, path, status, duration, ids. Never the query string's values, headers,
keys or bodies."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.infra import logs

access = logging.getLogger("spool.access")
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(scope: Scope) -> str | None:
    return scope.get("state", {}).get("request_id")


class RequestIdentity:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id")
        rid = given if given and _SANE.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = time.perf_counter()
        status = 500

        async def send_with_id(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                MutableHeaders(scope=msg)["x-request-id"] = rid
            await send(msg)

        with logs.bound(request_id=rid):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                principal = scope.get("state", {}).get("principal")
                access.info(
                    "%s %s %s",
                    scope["method"],
                    scope["path"],
                    status,
                    extra={
                        "method": scope["method"],
                        "path": scope["path"],
                        "status": status,
                        "duration_ms": round((time.perf_counter() - started) * 1000, 1),
                        "tenant_id": getattr(getattr(principal, "tenant", None), "id", None),
                    },
                )
