"""OpenAI-shaped errors: every non-2xx body is render.error_body's {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from sqlalchemy.exc import DataError, StatementError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from core.errors import DomainError, ErrorKind
from core.infra.transient import is_transient
from core.protocol import render
from core.protocol.errors import from_validation

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


_STATUS = {
    ErrorKind.invalid: 400,
    ErrorKind.unauthenticated: 401,
    ErrorKind.not_found: 404,
    ErrorKind.conflict: 409,
    ErrorKind.unprocessable: 422,
    ErrorKind.too_large: 413,
    ErrorKind.rate_limited: 429,
    ErrorKind.unavailable: 503,
}


class APIError(DomainError):
    """A DomainError with an explicit HTTP status: for what only the edge knows (credentials, URLs,
    body size) and for statuses no domain kind names (500)."""

    def __init__(self, status: int, message: str, **kw: Any) -> None:
        kind = next((k for k, v in _STATUS.items() if v == status), ErrorKind.invalid)
        super().__init__(kind, message, **kw)
        self.status = status


def status_of(exc: DomainError) -> int:
    return exc.status if isinstance(exc, APIError) else _STATUS[exc.kind]


def error_response(exc: DomainError) -> JSONResponse:
    status = status_of(exc)
    type_ = exc.type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(render.error_body(exc.message, type_, exc.param, exc.code), status, headers=exc.headers)


def validation_error(exc: RequestValidationError) -> DomainError:
    return from_validation(exc.errors())


def _internal() -> JSONResponse:
    """A bug on our side: still OpenAI's shape, with nothing about the cause (it is logged)."""
    return error_response(
        APIError(
            500, "The server had an error while processing your request.", type_="server_error", code="internal_error"
        )
    )


def _unavailable() -> JSONResponse:
    """Postgres or Redis away for a moment (a restart, a failover, a Redis refusing writes): nothing
    was stored by this request, so the client may simply retry; the `openai` SDK does so on a 503 by
    itself."""
    return error_response(
        APIError(
            503,
            "The service is briefly unavailable; please retry.",
            type_="server_error",
            code="service_unavailable",
            headers={"retry-after": "2"},
        )
    )


def is_unavailable(exc: BaseException) -> bool:
    """Postgres or Redis unavailable (as core/infra/transient.py tells: unreachable, every pooled
    connection busy, or Redis refusing writes for now: MISCONF, OOM, READONLY, ...): the client may retry."""
    return is_transient(exc)


def unavailable_response() -> JSONResponse:
    return _unavailable()


def install(app: FastAPI) -> None:
    @app.exception_handler(DomainError)
    async def _domain(_: Request, exc: DomainError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404 and message == "Not Found":
            message = "Unknown request URL. Please check the URL for typos."
        return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(StatementError)
    async def _database(_: Request, exc: StatementError) -> JSONResponse:
        # Values Postgres cannot store (NUL characters, unpaired surrogates, numbers past a column's
        # range) are the client's input, found only when stored: a 400, and nothing was written.
        if isinstance(exc, DataError) or isinstance(getattr(exc, "orig", None), ValueError):
            detail = str(getattr(exc, "orig", exc)).splitlines()[0][:200]
            return error_response(
                APIError(400, f"A value in the request cannot be stored: {detail}", code="invalid_value")
            )
        if is_transient(exc):
            log.warning("database unreachable: %s", type(getattr(exc, "orig", exc)).__name__)
            return _unavailable()
        log.exception("database error")
        return _internal()

    @app.exception_handler(PoolTimeout)
    async def _pool(_: Request, exc: Exception) -> JSONResponse:
        # Every database connection busy for the pool's timeout: overload, nothing stored; retry.
        log.warning("database pool exhausted")
        return _unavailable()

    @app.exception_handler(RedisError)
    async def _redis(_: Request, exc: Exception) -> JSONResponse:
        # Unreachable, or refusing writes for now (MISCONF, OOM, READONLY after a failover, ...): a
        # 503 the client retries. Any other reply error (WRONGTYPE, a script's error) is a bug: a 500.
        if is_transient(exc):
            log.warning("redis unavailable: %s: %s", type(exc).__name__, exc)
            return _unavailable()
        log.exception("redis error")
        return _internal()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        # The client hung up while its body was being read: nothing was stored and nobody reads an
        # answer. Not an error of ours (it was logged as an unhandled one, a 500): 499, as nginx counts it.
        log.info("client went away before its request body was read: %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        if is_transient(exc):  # an OSError, say, from a connection we do not wrap
            log.warning("unavailable: %s: %s", type(exc).__name__, exc)
            return _unavailable()
        # A bug: still answer in OpenAI's shape, and log it for the operator.
        log.exception("unhandled error")
        return _internal()
