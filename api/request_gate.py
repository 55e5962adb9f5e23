"""The per-minute limit a route's cost class takes, before its body is read (issues 25, 49).

A key limited to 1 request a minute could otherwise make the API read, parse and validate an 8 MiB
body for each refusal, and a tenant without limits could flood the reads that build large objects.
This ASGI middleware sits inside api/guard.py's (which has authenticated the caller without reading
the body and found the route's class, api/costs.py) and takes, by that class:

- `work`: the request from the tenant's and key's requests per minute (admission then takes only the
  other limits: core/tenancy/admission.REQUEST_TAKEN);
- `sized` and `cheap`: one read from the tenant's reads per minute (`SPOOL_READS_PER_MINUTE`);
- `public`: nothing.

A refusal is OpenAI's 429 and the body is never read. The tenant is also named for the prepare
threads (core/infra/threads.SHARE), so one tenant's bodies never hold all of them.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from api.costs import HEAVY_CAP, Declared
from api.errors import error_response
from core.config import Settings
from core.errors import DomainError
from core.infra import threads, transient
from core.tenancy import admission

log = logging.getLogger(__name__)


class RequestRateGate:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state", {}) if scope["type"] == "http" else {}
        declared: Declared | None = state.get("cost")
        principal = state.get("principal")
        redis = getattr(getattr(scope.get("app"), "state", None), "redis", None)
        if declared is None or declared.rate is None or principal is None or redis is None:
            await self.app(scope, receive, send)
            return
        try:
            if declared.rate == "requests":
                headers = await admission.take_request(redis, principal)
            else:
                await admission.take_read(redis, principal, self.settings.reads_per_minute)
                headers = None
        except DomainError as refused:
            await error_response(refused)(scope, receive, send)
            return
        except transient.REDIS:
            # Redis away: let the request through; what it reaches answers it (a 503) like any other.
            log.warning("request rate check skipped: Redis unavailable")
            headers = None
        share = threads.SHARE.set(principal.tenant.id)
        cap = HEAVY_CAP.set(self.settings.replays_per_tenant)
        token = admission.REQUEST_TAKEN.set(headers) if headers is not None else None
        try:
            await self.app(scope, receive, send)
        finally:
            if token is not None:
                admission.REQUEST_TAKEN.reset(token)
            threads.SHARE.reset(share)
            HEAVY_CAP.reset(cap)
