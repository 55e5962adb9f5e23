"""Pydantic's validation errors in OpenAI's words: the same message for an HTTP request and for a
batch line, so a client sees one wording wherever its request was checked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.errors import DomainError, ErrorKind, invalid


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union-branch labels ("str", "list[int]", ...) from the path.
    parts = [p for p in parts if not (p.startswith(("list[", "dict[")) or p in {"str", "int", "float", "bool"})]
    return ".".join(parts) or None


def from_validation(errors: Sequence[Any]) -> DomainError:
    """The first of pydantic's errors (`ValidationError.errors()`) as a 400 naming the parameter."""
    first = errors[0] if errors else {"type": "value_error", "loc": (), "msg": "Invalid request."}
    param = _param(tuple(first.get("loc", ())))
    kind = str(first.get("type") or "")
    if kind == "json_invalid":
        return DomainError(
            ErrorKind.invalid,
            "We could not parse the JSON body of your request. (HINT: This likely means "
            "you aren't using your HTTP library correctly. The OpenAI API expects a JSON "
            "payload.)",
            code="invalid_json",
        )
    if kind == "missing":
        return invalid(param, f"You must provide a '{param}' parameter.", "missing_parameter")
    if kind == "extra_forbidden":
        return invalid(param, f"Unrecognized request argument supplied: {param}", "unknown_parameter")
    if not param and kind.endswith("_type"):  # the body itself is not an object
        return invalid(None, "The request body must be a JSON object.", "invalid_type")
    msg = first.get("msg", "Invalid value.")
    return invalid(param, f"Invalid value for '{param}': {msg}")
