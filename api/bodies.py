"""JSON request bodies decoded and validated on the prepare threads, not on the event loop (issue 25).

FastAPI decodes a body and runs pydantic on it inside the event loop before the route runs: 200k
chat messages held every other request of the process for ~0.5-0.7 s. A route declares
`body: Annotated[Model, Depends(json_body(Model))]` instead: the bytes are read on the loop (bounded
by api/guard.py), decoded and validated on the `prepare` limiter (core/infra/threads), with the
errors FastAPI raises (same `RequestValidationError`, same locations; api/errors.py words them).

A thread alone does not free the loop: pydantic-core validates a whole list without releasing the
GIL. So validation runs on a copy of the model whose list and dict items each pass through a no-op
Python validator, a point where the interpreter hands the GIL to the loop thread (every 5 ms, the
switch interval). Decoding the JSON is still one uninterruptible call: what it costs (about 40 ms
for 7 MiB of chat messages with pydantic-core's parser, 60-85 ms with `json.loads`) is the stall
that remains.
"""

from __future__ import annotations

import email.message
import gc
import json
import threading
import types
import typing
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, ValidationError, create_model
from pydantic_core import from_json, to_json
from starlette.exceptions import HTTPException

from core.infra import threads

M = TypeVar("M", bound=BaseModel)


def _yield_gil(value: Any) -> Any:
    return value  # a Python frame per item: where the interpreter may hand the GIL to the loop


_TICK = AfterValidator(_yield_gil)


def _ticking_type(tp: Any) -> Any:
    """`tp` with each list item and dict value validated through `_yield_gil` (otherwise the same)."""
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *meta = get_args(tp)
        return Annotated[(_ticking_type(inner), *meta)]
    if origin in (Union, types.UnionType):
        return Union[tuple(_ticking_type(a) for a in get_args(tp))]  # noqa: UP007
    if origin is list:
        (item,) = get_args(tp)
        return list[Annotated[_ticking_type(item), _TICK]]  # type: ignore[misc]
    if origin is dict:
        key, value = get_args(tp)
        return dict[key, Annotated[_ticking_type(value), _TICK]]  # type: ignore[misc,valid-type]
    return tp


@cache
def ticking(model: type[M]) -> type[M]:
    """A subclass of `model`, same name, fields and errors, whose list items and dict values yield
    the GIL as they are validated. Nested models keep their own classes (they are small)."""
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        tp = _ticking_type(info.annotation)
        if tp is not info.annotation:
            copied = info._copy()
            copied.annotation = tp
            fields[name] = (tp, copied)
    sub = create_model(model.__name__, __base__=model, __module__=model.__module__, **fields)
    return typing.cast(type[M], sub)


_WRAPPER = "function-after[_yield_gil(), "


def _original_label(part: Any) -> Any:
    """A union branch's label in an error location as the untouched model names it (`list[str]`,
    not `list[function-after[_yield_gil(), str]]`)."""
    while isinstance(part, str) and _WRAPPER in part:
        start = part.index(_WRAPPER)
        depth, end = 1, start + len(_WRAPPER)
        while depth:  # the wrapper's closing bracket
            depth += {"[": 1, "]": -1}.get(part[end], 0)
            end += 1
        part = part[:start] + part[start + len(_WRAPPER) : end - 1] + part[end:]
    return part


def _is_json(content_type: str | None) -> bool:
    # FastAPI's rule (strict content type): only application/json and application/*+json are decoded.
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


_GC = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = True


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic collector held back while a body is decoded and validated: the millions of
    containers a big body makes trigger full collections that tripled the cost (each one holding
    the GIL, so stalling the loop too), and a decoded body holds no cycles to collect."""
    global _gc_pauses, _gc_was_enabled
    with _GC:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _GC:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


# A body this small is decoded and validated on the loop, with the plain model: tens of microseconds,
# less than the thread hop (a future, a worker wake-up, a call back into the loop) that would carry it.
INLINE_BYTES = 4096


def parse(model: type[M], raw: bytes, content_type: str | None) -> M:
    """`raw` as `model`, or the exception FastAPI raises for it. Blocking: call it on a thread."""
    with _gc_paused():
        return _parse(ticking(model), raw, content_type)


def _loads(raw: bytes) -> Any:
    """`json.loads(raw)`. pydantic-core's parser (jiter) decodes a big body in half the time (one
    uninterruptible call either way: this is the stall that remains) and gives the same values for
    what it accepts; what it refuses (bad JSON, UTF-16/32, a BOM, a lone surrogate, deep nesting)
    goes to `json.loads`, whose answer and errors FastAPI's were."""
    try:
        return from_json(raw)
    except ValueError:
        return json.loads(raw)


def _parse(model: type[M], raw: bytes, content_type: str | None) -> M:
    if not raw:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    value: Any = raw  # not JSON: validated as bytes, and refused as "not an object"
    if _is_json(content_type):
        try:
            value = _loads(raw)
        except json.JSONDecodeError as e:
            err = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
            raise RequestValidationError([{**err, "ctx": {"error": e.msg}}], body=e.doc) from e
        except RecursionError as e:  # arrays or objects nested ~1,000 deep: a 400, not the 500 it was
            err = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {}}
            raise RequestValidationError([{**err, "ctx": {"error": "Nested too deeply"}}]) from e
        except ValueError as e:  # not UTF-8/16/32
            raise HTTPException(400, "There was an error parsing the body") from e
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *map(_original_label, err["loc"]))} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=value) from None


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency: the request's body as `model`, decoded and validated off the event loop."""
    # Built now, at import: the first big body used to build it on the prepare thread, and building
    # a pydantic validator is one call that holds the GIL (CI saw the loop silent for 0.56 of that
    # first chat body's parse window, against 0.09-0.17 for every later one).
    ticking(model)

    async def body(request: Request) -> M:
        raw = await request.body()
        if len(raw) <= INLINE_BYTES:
            return _parse(model, raw, request.headers.get("content-type"))
        return await threads.run("prepare", parse, model, raw, request.headers.get("content-type"))

    return body


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise ValueError(f"recursive schema {name}: cannot be inlined")
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return {**_inline(defs[name], defs, (*seen, name)), **_inline(rest, defs, seen)}
        return {k: _inline(v, defs, seen) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs, seen) for v in node]
    return node


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting `model` as the route's JSON body (FastAPI no longer sees it as a
    body parameter). Self-contained: nested models are inlined, the document's components not needed."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _inline(schema, defs)}}}}


def openapi_answers(model: type[BaseModel], chunk: type[BaseModel], job: type[BaseModel], error: type[BaseModel]):
    """`responses` of a route that answers `model` as JSON, or with `stream: true` a stream of `chunk`
    events (text/event-stream, described: OpenAPI 3.1 has no schema for a sequence of events, so the
    chunk's schema rides along, inlined, as `x-sse-data`), 202 with `job` when the client asked to
    run it async (or the wait ran out), and `error` for the job that did not succeed."""
    schema = chunk.model_json_schema()
    chunk_schema = _inline(schema, schema.pop("$defs", {}))
    sse = {
        "type": "string",
        "description": "Server-sent events with `stream: true`: each event has an `id:` (send it back as "
        f"`Last-Event-ID` to resume) and one `data:` line holding a {chunk.__name__} as JSON; the last "
        'event is `data: [DONE]`. A job that fails mid-stream sends `data: {"error": ...}` before it. '
        "Keep-alives are comment lines.",
        "x-sse-data": chunk_schema,
    }
    return {
        200: {"description": f"The {model.__name__}, or its stream", "content": {"text/event-stream": {"schema": sse}}},
        202: {"model": job, "description": "Stored and running (`Prefer: respond-async`, or the wait ran out)"},
        400: {"model": error, "description": "The request is invalid (nothing stored), or the job ended on it"},
        409: {"model": error, "description": "The job was cancelled"},
        422: {"model": error, "description": "The job failed"},
        429: {"model": error, "description": "A rate limit or quota refused it (see `retry-after`)"},
    }


# -- responses: built and encoded off the event loop (issue 35) --------------------------------------
# FastAPI validates a returned dict against the route's `response_model` and encodes it on the loop:
# 2M token ids, or 40 batches of big metadata, held every other request for seconds. A route whose
# answer's size the client controls builds it on a thread and returns these bytes instead (the
# `response_model` still documents them).

_SLICE_BYTES = 1 << 18  # about what one uninterruptible encoding call may produce


def _put(out: bytearray, value: Any, depth: int) -> None:
    if depth < 4 and isinstance(value, dict):
        out += b"{"
        for i, (k, v) in enumerate(value.items()):
            out += b"," if i else b""
            out += to_json(str(k))
            out += b":"
            _put(out, v, depth + 1)
        out += b"}"
    elif depth < 4 and isinstance(value, list | tuple):
        out += b"["
        i, n = 0, 1
        while i < len(value):  # slices that grow while each encodes small, and shrink when one does not
            part = to_json(value[i : i + n])
            out += b"," if i else b""
            out += memoryview(part)[1:-1]
            i += n
            n = n * 2 if len(part) < _SLICE_BYTES else max(1, n // 2)
        out += b"]"
    else:
        out += to_json(value)


def encode(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON, encoded a slice at a time: each call into the encoder holds the
    GIL for what one slice costs (about 256 KiB of output), so the loop thread runs between them.
    Blocking: call it on a thread (`json_response`)."""
    out = bytearray()
    with _gc_paused():
        _put(out, value, 0)
    return bytes(out)


async def json_response(build: Callable[..., Any], *args: Any, status: int = 200) -> Response:
    """`build(*args)` (blocking: a query on a sync session, a tokenizer...) run and encoded on the
    `prepare` threads; the answer is sent as those bytes, with nothing left to do on the loop."""

    def work() -> bytes:
        return encode(build(*args))

    return Response(await threads.run("prepare", work), status_code=status, media_type="application/json")
