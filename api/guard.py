"""Before any request body is read: who is calling, and how large the body may be.

FastAPI reads and parses a body before it resolves dependencies, so an anonymous client could make
the API buffer (or spool to disk) as much as it sends, chunked bodies having no Content-Length.
This ASGI middleware authenticates every request to a route that charges a tenant first (401 without
reading a body), refuses a declared length over the route's limit (413), and counts the bytes of the
stream as the application reads them, answering 413 the moment the limit is passed. The route's limit
and whether it has a tenant come from its cost class (api/costs.py), found once here and kept in the
request's scope for the gates inside.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import costs
from api.cache import SingleFlight
from api.errors import APIError, error_response, is_unavailable, unavailable_response
from core.config import Settings
from core.errors import DomainError
from core.infra import redis_keys
from core.tenancy.keys import Principal, hash_key, principal_of

log = logging.getLogger(__name__)

MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


# Key lookups are cached for a few seconds (one query per key, not per request); a revocation is
# seen at once all the same: the revoking side marks the key in Redis, checked on every hit.
_KEYS: SingleFlight[Principal | None] = SingleFlight(ttl_s=5.0)


async def authenticate(authorization: str | None, redis: Any, sessions: async_sessionmaker[AsyncSession]) -> Principal:
    """The tenant and key behind a Bearer header, looked up on `sessions` (the app's async session
    factory, core/tenancy/keys.principal_of); a key marked revoked in `redis` is looked up afresh."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, MISSING_KEY, code="missing_api_key", type_="invalid_request_error")
    digest = hash_key(key.strip())

    async def load() -> Principal | None:
        return await principal_of(sessions, key.strip())

    principal = await _KEYS.get(digest, load)
    if principal is not None and redis is not None and await redis.exists(redis_keys.revoked(digest)):
        _KEYS.forget(digest)
        principal = await _KEYS.get(digest, load)
    if principal is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", type_="invalid_request_error")
    return principal


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = costs.of(scope)
        scope.setdefault("state", {})["cost"] = declared
        # No such route (a 404 or 405 to come) or one that charges nobody: no key is asked for here.
        charged = declared is not None and declared.cost is not costs.Cost.PUBLIC
        with_body = scope["method"] in ("POST", "PUT", "PATCH", "DELETE")
        if not charged and not with_body:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = declared.body_limit(self.settings) if declared is not None else costs.PUBLIC_BODY
        length = headers.get("content-length")
        try:
            if length is not None and (not length.isdigit() or int(length) > limit):
                raise APIError(
                    413, f"Request body too large: {length} bytes (limit {limit}).", code="request_too_large"
                )
            state = scope["app"].state  # the services api/app.py built at startup
            if charged:
                principal = await authenticate(headers.get("authorization"), state.redis, state.async_sessions)
                scope["state"]["principal"] = principal
        except DomainError as refused:
            await error_response(refused)(scope, receive, send)
            return
        except Exception as exc:
            # Authentication outside the routes' exception handlers: a database or Redis outage longer
            # than the key cache must still be the 503 + Retry-After every route answers, not a 500.
            if not is_unavailable(exc):
                raise
            log.warning("authentication unavailable: %s", type(exc).__name__)
            await unavailable_response()(scope, receive, send)
            return

        seen = 0
        too_large = False

        async def bounded() -> Message:
            nonlocal seen, too_large
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    too_large = True
                    return {"type": "http.disconnect"}  # the application stops reading here
            return msg

        async def guarded_send(msg: Message) -> None:
            if not too_large:  # once over the limit, the answer is ours
                await send(msg)

        started = False

        async def tracked_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await guarded_send(msg)

        try:
            await self.app(scope, bounded, tracked_send)
        except Exception as exc:
            if too_large:
                pass
            elif is_unavailable(exc) and not started:  # raised by a middleware inside this one
                log.warning("request unavailable: %s", type(exc).__name__)
                await unavailable_response()(scope, receive, send)
                return
            else:
                raise
        if too_large:
            too_big = APIError(413, f"Request body too large (limit {limit} bytes).", code="request_too_large")
            await error_response(too_big)(scope, receive, send)
