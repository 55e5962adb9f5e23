"""Each route declares what it costs once; the declaration brings the bounds (issue 49).

Bounds written by hand per route were forgotten by the next route (the Responses API reopened the
holes the job routes had closed). So every route carries one of four classes, and the edge applies
what the class implies, whatever the handler remembers:

- `work` (makes work the size of its body: a job, a batch, a file, a tokenization): the tenant's and
  key's requests per minute before the body is read; `SPOOL_MAX_BODY_BYTES` (uploads:
  `SPOOL_MAX_FILE_BYTES`) or the route's own smaller limit, the body parsed off the loop unless that
  limit is 64 KiB; its preparation holds at most the tenant's share of the prepare threads.
- `sized` (answers an object whose size the client's data sets): the tenant's reads per minute
  (`SPOOL_READS_PER_MINUTE`) before any work; 64 KiB of body; the answer built and encoded on the
  prepare threads inside the tenant's heavy gate (the handler returns `OffLoop`), or streamed.
- `cheap` (a bounded answer): the tenant's reads per minute; 64 KiB of body.
- `public` (no tenant: probes, the OpenAPI document, the status page): 4 KiB of body, nothing to take.

`check(app)` (run by api/app.create_app) refuses an application with a route of no class, a `sized`
route whose handler does not return `OffLoop` or a streamed answer, or a body parsed on the event
loop with a limit over 64 KiB; tests/unit/test_route_costs.py plants each.
"""

from __future__ import annotations

import enum
import functools
import inspect
import re
import typing
import weakref
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts
from starlette.responses import Response, StreamingResponse
from starlette.routing import compile_path
from starlette.types import Scope

from api import bodies
from api.sse import HEAVY
from core.config import Settings
from core.infra import threads

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

SMALL_BODY = 64 * 1024  # a body this small costs the loop little to parse (FastAPI parses it there)
PUBLIC_BODY = 4096


class Cost(enum.StrEnum):
    WORK = "work"
    SIZED = "sized"
    CHEAP = "cheap"
    PUBLIC = "public"


class Body(enum.StrEnum):
    """Which body limit a route takes (api/guard.py)."""

    REQUEST = "request"  # SPOOL_MAX_BODY_BYTES
    FILE = "file"  # SPOOL_MAX_FILE_BYTES plus a form's envelope
    SMALL = "small"  # SMALL_BODY
    PUBLIC = "public"  # PUBLIC_BODY


_DEFAULT_BODY = {Cost.WORK: Body.REQUEST, Cost.SIZED: Body.SMALL, Cost.CHEAP: Body.SMALL, Cost.PUBLIC: Body.PUBLIC}


@dataclass(frozen=True)
class Declared:
    cost: Cost
    body: Body

    def body_limit(self, s: Settings) -> int:
        return {
            Body.REQUEST: s.max_body_bytes,
            Body.FILE: s.max_file_bytes + (1 << 20),
            Body.SMALL: SMALL_BODY,
            Body.PUBLIC: PUBLIC_BODY,
        }[self.body]

    @property
    def rate(self) -> str | None:
        """Which per-minute limit the pre-body gate takes: `requests` (the tenant's rpm), `reads`, none."""
        return {Cost.WORK: "requests", Cost.SIZED: "reads", Cost.CHEAP: "reads", Cost.PUBLIC: None}[self.cost]


_ATTR = "__spool_cost__"


def declared(endpoint: Any) -> Declared | None:
    return getattr(endpoint, _ATTR, None)


def _mark(fn: F, cost: Cost, body: Body | None) -> F:
    setattr(fn, _ATTR, Declared(cost, body or _DEFAULT_BODY[cost]))
    return fn


def work(fn: F | None = None, *, body: Body | None = None) -> Any:
    """The route makes work the size of its body (`@work`, or `@work(body=Body.FILE)`). Below the
    router's decorator, so the router registers what this returns."""
    if fn is None:
        return lambda f: _mark(f, Cost.WORK, body)
    return _mark(fn, Cost.WORK, body)


def cheap(fn: F) -> F:
    return _mark(fn, Cost.CHEAP, None)


def public(fn: F) -> F:
    return _mark(fn, Cost.PUBLIC, None)


@dataclass
class OffLoop:
    """What a `sized` route returns: how to build its answer, not the answer. `sized` builds and
    encodes it on the prepare threads, inside the tenant's heavy gate; `inline` (the handler knows
    the object is small, e.g. a job without scores) skips the thread hop and the gate."""

    tenant_id: int
    build: Callable[..., Any]
    args: tuple[Any, ...] = ()
    status: int = 200
    inline: bool = False
    headers: dict[str, str] = field(default_factory=dict)


# What a sized route may return besides OffLoop: an answer sent as it is produced, whose producer
# carries its own gates (api/sse.sse_chunks, the file downloads).
_STREAMED = (StreamingResponse,)


def _streamed_type(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, _STREAMED)


def _return_hint(fn: Callable[..., Any]) -> Any:
    """`fn`'s return annotation, resolved in its module (annotations are strings here)."""
    ann = inspect.signature(fn).return_annotation
    if isinstance(ann, str):
        ann = eval(ann, inspect.unwrap(fn).__globals__)
    return ann


def _sized_return_ok(annotation: Any) -> bool:
    args = typing.get_args(annotation) or (annotation,)
    return all(a is OffLoop or _streamed_type(a) for a in args)


def sized(fn: F) -> F:
    """The route answers an object whose size the client's data sets. Its handler returns `OffLoop`
    (or a streamed answer); this wrapper builds and encodes it off the loop in the tenant's gate."""
    try:
        hint = _return_hint(fn)
    except NameError:  # a type its module defines further down: check(app) reads it once all is loaded
        hint = OffLoop
    if not _sized_return_ok(hint):
        raise TypeError(
            f"{fn.__qualname__}: a sized route returns OffLoop (or a streamed answer), not "
            f"{hint!r}: its body would be built on the event loop"
        )

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = await fn(*args, **kwargs)
        if isinstance(out, OffLoop):
            return await build(out)
        if isinstance(out, _STREAMED):
            return out
        raise TypeError(f"{fn.__qualname__} returned {type(out).__name__}, built on the event loop")

    return _mark(typing.cast(F, wrapper), Cost.SIZED, None)


# How many heavy builds one tenant may run at once (SPOOL_REPLAYS_PER_TENANT), set per request by the
# rate gate (api/request_gate.py) from the settings api/app.py hands it.
HEAVY_CAP: ContextVar[int] = ContextVar("spool_heavy_cap", default=2)


async def build(out: OffLoop) -> Response:
    if out.inline:
        body = bodies.encode(out.build(*out.args))
    else:
        async with HEAVY.hold(out.tenant_id, HEAVY_CAP.get()):
            body = await threads.run("prepare", lambda: bodies.encode(out.build(*out.args)))
    return Response(body, status_code=out.status, media_type="application/json", headers=out.headers or None)


# -- the route table -------------------------------------------------------------------------------


def routes(app: Any) -> list[RouteContext]:
    """The application's effective routes (FastAPI resolves included routers lazily, each with its
    prefix), in the router's order."""
    return list(iter_route_contexts(app.router.routes))


@dataclass(frozen=True)
class _Entry:
    path: re.Pattern[str]
    methods: frozenset[str]  # empty: any method
    declared: Declared | None


_TABLES: weakref.WeakKeyDictionary[Any, tuple[int, list[_Entry]]] = weakref.WeakKeyDictionary()


def _table(app: Any) -> list[_Entry]:
    """Each route's path pattern (starlette's own compilation), methods and class, kept per application
    until a route is added: matching a scope against FastAPI's route objects cost 30-140 us a request."""
    size = len(app.router.routes)
    known = _TABLES.get(app)
    if known is None or known[0] != size:
        entries = [
            _Entry(compile_path(r.path)[0], frozenset(r.methods or ()), declared(r.endpoint))
            for r in routes(app)
            if r.path is not None
        ]
        known = _TABLES[app] = (size, entries)
    return known[1]


def of(scope: Scope) -> Declared | None:
    """The declaration of the route `scope` will reach, or None (no such route: a 404 or 405 later).
    Middleware runs before routing, so the path is matched here the way the router will."""
    app = scope.get("app")
    if app is None:
        return None
    path, method = scope["path"], scope["method"]
    for e in _table(app):
        if e.path.match(path) and (not e.methods or method in e.methods):
            return e.declared
    return None


def check(app: FastAPI, settings: Settings) -> None:
    """Refuse an application whose routes are not all declared, or declared against their code."""
    problems: list[str] = []
    for route in routes(app):
        endpoint = route.endpoint
        name = f"{','.join(sorted(route.methods or []))} {route.path}"
        d = declared(endpoint)
        if d is None:
            problems.append(f"{name}: no cost class (api/costs.py: @work, @sized, @cheap or @public)")
            continue
        original = route.original_route
        if isinstance(original, APIRoute) and original.body_field is not None and d.body_limit(settings) > SMALL_BODY:
            problems.append(f"{name}: a body FastAPI parses on the event loop, with a limit over {SMALL_BODY} bytes")
        if d.cost is Cost.SIZED and endpoint is not None:
            hint = _return_hint(endpoint)
            if not _sized_return_ok(hint):
                problems.append(f"{name}: sized, but its handler returns {hint!r}, a body built on the loop")
    if problems:
        raise RuntimeError("routes declared wrongly:\n  " + "\n  ".join(problems))


def markdown(app: Any, settings: Settings) -> str:
    """The route table as docs/reliability.md shows it (tests/unit/test_route_costs.py keeps it current)."""
    rows = ["| method | path | class | per-minute limit before work | body limit |", "| --- | --- | --- | --- | --- |"]
    for r in routes(app):
        d = declared(r.endpoint)
        if d is None or r.path is None or (not getattr(r, "include_in_schema", True) and d.cost is Cost.PUBLIC):
            continue
        rate = {"requests": "the tenant's and key's rpm", "reads": "the tenant's reads", None: "none"}[d.rate]
        for m in sorted((r.methods or set()) - {"HEAD"}):
            rows.append(f"| {m} | `{r.path}` | {d.cost.value} | {rate} | {d.body_limit(settings):,} B |")
    return "\n".join(rows)
