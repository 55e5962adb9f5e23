"""Every route declares its cost class, and the class brings its bounds (api/costs.py, issue 49).

The application's own route table is walked: a route without a class, a `sized` route whose handler
builds its body on the loop, or a body FastAPI parses on the loop past 64 KiB stops the application
from being built. Each is planted here and shown refused. No services: the lifespan does not run."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel

from api import costs
from api.app import create_app
from api.costs import Body, Cost, OffLoop, sized, work
from core.config import get_settings


def _app_with(router: APIRouter) -> FastAPI:
    app = create_app()
    app.include_router(router)
    return app


def test_the_application_declares_every_route():
    app = create_app()  # check() runs inside: it would raise
    seen = {r.path for r in costs.routes(app) if costs.declared(r.endpoint)}
    assert {"/v1/completions", "/v1/responses", "/v1/jobs/{job_id}", "/v1/files", "/health", "/openapi.json"} <= seen
    costs.check(app, get_settings())


def test_a_planted_undeclared_route_is_refused():
    router = APIRouter()

    @router.get("/v1/planted")
    async def planted() -> dict:
        return {}

    with pytest.raises(RuntimeError, match=r"GET /v1/planted: no cost class"):
        costs.check(_app_with(router), get_settings())


def test_a_sized_wrapper_above_the_router_decorator_is_no_declaration():
    """The router registers what is below it: `sized` put above it wraps a function nobody calls,
    and the route the router holds builds its body on the loop undeclared."""
    router = APIRouter()

    @sized
    @router.get("/v1/planted", response_model=None)
    async def planted() -> OffLoop:
        return OffLoop(1, dict)

    with pytest.raises(RuntimeError, match="no cost class"):
        costs.check(_app_with(router), get_settings())


def test_a_sized_handler_that_builds_its_body_on_the_loop_is_refused():
    with pytest.raises(TypeError, match="built on the event loop"):

        @sized
        async def planted() -> dict:
            return {"data": ["x"] * 10}


def test_a_sized_handler_returning_something_else_at_run_time_is_refused():
    async def lying() -> OffLoop:
        return {"data": []}  # type: ignore[return-value]  # what mypy catches in CI; here, the wrapper does

    wrapped = sized(lying)
    import asyncio

    with pytest.raises(TypeError, match="built on the event loop"):
        asyncio.run(wrapped())


class Big(BaseModel):
    items: list[str]


def test_a_large_body_parsed_on_the_loop_is_refused():
    router = APIRouter()

    @router.post("/v1/planted")
    @work
    async def planted(body: Big) -> dict:
        return {}

    with pytest.raises(RuntimeError, match="parses on the event loop"):
        costs.check(_app_with(router), get_settings())

    small = APIRouter()

    @small.post("/v1/planted-small")
    @work(body=Body.SMALL)
    async def planted_small(body: Big) -> dict:
        return {}

    costs.check(_app_with(small), get_settings())  # a 64 KiB body is cheap to parse on the loop


def test_what_each_class_brings():
    s = get_settings()
    creates = costs.Declared(Cost.WORK, Body.REQUEST)
    assert (creates.rate, creates.body_limit(s)) == ("requests", s.max_body_bytes)
    assert costs.Declared(Cost.WORK, Body.FILE).body_limit(s) > s.max_file_bytes
    for c in (Cost.SIZED, Cost.CHEAP):
        d = costs.Declared(c, Body.SMALL)
        assert (d.rate, d.body_limit(s)) == ("reads", costs.SMALL_BODY)
    assert costs.Declared(Cost.PUBLIC, Body.PUBLIC).rate is None


@pytest.mark.parametrize(
    ("method", "path", "cost"),
    [
        ("POST", "/v1/completions", Cost.WORK),
        ("POST", "/v1/chat/completions", Cost.WORK),
        ("POST", "/v1/responses", Cost.WORK),
        ("POST", "/tokenize", Cost.WORK),
        ("POST", "/v1/files", Cost.WORK),
        ("POST", "/v1/batches", Cost.WORK),
        ("GET", "/v1/jobs/cmpl-1", Cost.SIZED),
        ("GET", "/v1/jobs/cmpl-1/events", Cost.SIZED),
        ("POST", "/v1/jobs/cmpl-1/cancel", Cost.SIZED),
        ("GET", "/v1/responses/resp_1", Cost.SIZED),
        ("POST", "/v1/responses/resp_1/cancel", Cost.SIZED),
        ("GET", "/v1/responses/resp_1/input_items", Cost.SIZED),
        ("GET", "/v1/files", Cost.SIZED),
        ("GET", "/v1/batches/batch_1", Cost.SIZED),
        ("GET", "/v1/models", Cost.CHEAP),
        ("GET", "/health", Cost.PUBLIC),
    ],
)
def test_a_request_finds_its_routes_class(method: str, path: str, cost: Cost):
    """What the gates see for a request, before routing: the class of the route it will reach."""
    app = create_app()
    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "app": app, "root_path": ""}
    d = costs.of(scope)
    assert d is not None and d.cost is cost


def test_the_route_table_in_the_docs_is_the_codes():
    from pathlib import Path

    from core.config import Settings

    doc = (Path(__file__).parents[2] / "docs" / "reliability.md").read_text()
    shown = doc.split("<!-- routes:begin -->\n", 1)[1].split("\n<!-- routes:end -->", 1)[0]
    assert shown == costs.markdown(create_app(), Settings()), "regenerate with api.costs.markdown"
