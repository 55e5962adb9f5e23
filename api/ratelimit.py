"""Requests per minute taken before a body is read (issue 25: cheap refusals before expensive work).

A key limited to 1 request a minute could otherwise make the API read, parse and validate an 8 MiB
body for each refusal. This ASGI middleware sits inside api/guard.py's (which has authenticated the
caller without reading the body) and takes the request from the tenant's and key's requests-per-
minute for the routes that create jobs; admission then takes only the other limits
(core/tenancy/admission.REQUEST_TAKEN). A refusal is OpenAI's 429 and the body is never read.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_response
from core.errors import DomainError
from core.infra import transient
from core.tenancy import admission

log = logging.getLogger(__name__)


def _creates_job(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/").endswith("/completions")


class RequestRateGate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        principal = scope.get("state", {}).get("principal") if _creates_job(scope) else None
        redis = getattr(getattr(scope.get("app"), "state", None), "redis", None)
        if principal is None or redis is None:
            await self.app(scope, receive, send)
            return
        try:
            headers = await admission.take_request(redis, principal)
        except DomainError as refused:
            await error_response(refused)(scope, receive, send)
            return
        except transient.REDIS:
            # Redis away: let the request through; admission answers it (a 503) like any other.
            log.warning("request rate check skipped: Redis unavailable")
            await self.app(scope, receive, send)
            return
        token = admission.REQUEST_TAKEN.set(headers)
        try:
            await self.app(scope, receive, send)
        finally:
            admission.REQUEST_TAKEN.reset(token)
