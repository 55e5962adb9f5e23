"""One error type for every core service: what went wrong, in terms a client can act on.

Services raise `DomainError`; the HTTP edge (api/errors.py) maps its `kind` to a status code and
renders OpenAI's error object, batch ingest records it against the line, the CLI prints it. Nothing
below api/ knows about HTTP.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    invalid = "invalid"  # the request itself is wrong (400)
    unauthenticated = "unauthenticated"  # no or bad credentials (401)
    not_found = "not_found"  # absent, or another tenant's (404: never 403)
    conflict = "conflict"  # the object's state forbids it, or a twin request is in flight (409)
    unprocessable = "unprocessable"  # well-formed but cannot be honoured as sent (422)
    too_large = "too_large"  # a body or upload past its bound (413)
    rate_limited = "rate_limited"  # a tenant limit (429)
    unavailable = "unavailable"  # nothing can serve it now (503)


class DomainError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code
        self.type = type_  # OpenAI's `type` when it is not the kind's usual one (429: "tokens")
        self.headers = headers


def invalid(param: str | None, message: str, code: str = "invalid_value") -> DomainError:
    return DomainError(ErrorKind.invalid, message, param=param, code=code)


def not_found(message: str, *, param: str | None = None, code: str | None = None) -> DomainError:
    return DomainError(ErrorKind.not_found, message, param=param, code=code)
