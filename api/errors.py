"""OpenAI-shaped errors: every non-2xx body is {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, StatementError
from starlette.exceptions import HTTPException as StarletteHTTPException

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


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status, headers=exc.headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union-branch labels ("str", "list[int]", ...) from the path.
    parts = [p for p in parts if not (p.startswith(("list[", "dict[")) or p in {"str", "int", "float", "bool"})]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "value_error", "loc": (), "msg": "Invalid request."}
    param = _param(tuple(first.get("loc", ())))
    kind = first.get("type")
    if kind == "json_invalid":
        return APIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means "
            "you aren't using your HTTP library correctly. The OpenAI API expects a JSON "
            "payload.)",
            code="invalid_json",
        )
    if kind == "missing":
        return APIError(400, f"You must provide a '{param}' parameter.", param=param, code="missing_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if not param and (kind or "").endswith("_type"):  # the body itself is not an object
        return APIError(400, "The request body must be a JSON object.", code="invalid_type")
    msg = first.get("msg", "Invalid value.")
    return APIError(400, f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


def _internal() -> JSONResponse:
    """A bug on our side: still OpenAI's shape, with nothing about the cause (it is logged)."""
    return error_response(
        APIError(
            500, "The server had an error while processing your request.", type_="server_error", code="internal_error"
        )
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
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
        log.exception("database error")
        return _internal()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug: still answer in OpenAI's shape, and log it for the operator.
        log.exception("unhandled error")
        return _internal()
