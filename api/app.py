"""The FastAPI application: routes, error shapes, body limit, health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
    start_http_server,
)
from sqlalchemy import text

from api import costs, errors
from api.deps import AdminDep
from api.guard import RequestGuard
from api.observe import RequestIdentity
from api.request_gate import RequestRateGate
from api.routes import (
    admin,
    batches,
    chat_store,
    completions,
    files,
    jobs,
    models,
    responses,
    tokens,
    ui,
    usage,
    webhooks,
)
from core.config import get_settings
from core.errors import DomainError
from core.idempotency import Idempotency
from core.infra import heap, kv, logs
from core.infra.broker import AsyncSender
from core.infra.db import async_engine, async_sessions, sync_sessions
from core.infra.streams import read
from core.infra.tokenizers import tokenizer_for
from core.jobs import live_workers
from core.jobs.lifecycle import Lifecycle
from core.jobs.responses import Responses
from core.jobs.service import Completions
from core.protocol import render

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings = get_settings()
    app.state.redis = kv.async_client(
        settings.redis_url, decode_responses=True, max_connections=settings.redis_max_connections
    )
    # Every event stream this process follows, read by one blocking XREAD (core/infra/streams/read.Hub).
    app.state.hub = read.Hub(app.state.redis)
    # The services, wired once here: routes get them (and the sync sessions) through api/deps.py.
    app.state.sync_sessions = sync_sessions()
    app.state.async_sessions = async_sessions()
    sync_redis = kv.client(settings.redis_url)
    # Jobs end through the one sync lifecycle (also the worker's and dispatcher's), run in a thread.
    app.state.lifecycle = Lifecycle(app.state.sync_sessions, sync_redis, settings)
    app.state.sync_redis = sync_redis
    # What a rendered completion names as its `system_fingerprint`, per model (rendering reads no settings).
    app.state.fingerprints = render.Fingerprints(settings)
    app.state.idempotency = Idempotency(app.state.async_sessions, settings.idempotency_lock_s)
    sender = AsyncSender(
        settings.celery_broker_url, settings.interactive_group, settings.affinity_spill_load, settings.affinity_key_rate
    )
    app.state.completions = Completions(
        app.state.async_sessions, app.state.redis, settings, app.state.idempotency, sender, tokenizer_for
    )
    # The Responses API: chat jobs with another wire shape (its own Submitter, the same path).
    app.state.responses = Responses(
        app.state.async_sessions, app.state.redis, settings, app.state.idempotency, sender, tokenizer_for
    )
    _drain_on_sigterm(app)
    if settings.api_metrics_port:
        _serve_metrics_port(settings.api_metrics_port)
    for model in settings.model_ids:  # load tokenizers now, not on the first request
        try:
            await anyio.to_thread.run_sync(tokenizer_for, model)
        except (DomainError, OSError, RuntimeError) as e:
            # A registry entry whose weights are not on this host yet (the example registry lists GPU
            # models a CPU-only host never downloads) must not keep the API from serving the others.
            log.warning("model %s: tokenizer not loaded (%s)", model, e)
    heap.freeze_startup()  # full collections no longer walk the startup heap mid-burst (core/infra/heap.py)
    yield
    await app.state.hub.aclose()
    await sender.aclose()
    await app.state.redis.aclose()
    await async_engine().dispose()


def _metrics_registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # `spool api --workers N`: the sum over processes
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


def _serve_metrics_port(port: int) -> None:
    """The metrics on their own port. With `--workers N` every process tries; the first to bind
    serves the sum over all of them (multiprocess registry), the others find the port taken."""
    try:
        start_http_server(port, registry=_metrics_registry())
    except OSError:
        log.debug("metrics port %d already served by another API process", port)


def _drain_on_sigterm(app: FastAPI) -> None:
    """On SIGTERM, mark the process as draining before uvicorn's own handler stops it: streams it
    then closes end without cancelling their jobs (the jobs go on; clients re-attach elsewhere)."""
    app.state.draining = False
    # Set when draining starts: requests waiting for a job's answer give up their wait at once
    # (api/routes/completions.py) instead of being cancelled by uvicorn's shutdown timeout (a 500).
    app.state.drained = drained = asyncio.Event()
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        app.state.draining = True
        loop.call_soon_threadsafe(drained.set)
        if callable(previous):
            previous(signum, frame)

    with contextlib.suppress(ValueError):  # not the main thread (e.g. a test client): nothing to chain
        signal.signal(signal.SIGTERM, on_term)


def create_app() -> FastAPI:
    settings = get_settings()
    app = FastAPI(
        title="Spool", version="0.1.0", lifespan=lifespan, description="Queue-backed, OpenAI-compatible completions."
    )
    logs.setup(settings.log_format)
    errors.install(app)

    # inside the guard: after authentication, before the body is read
    app.add_middleware(RequestRateGate, settings=settings)
    app.add_middleware(RequestGuard, settings=settings)
    app.add_middleware(RequestIdentity)  # outermost: every response, errors included, carries the id

    app.include_router(completions.router)
    app.include_router(chat_store.router)  # the stored chat completions (`store: true`)
    app.include_router(responses.router)
    app.include_router(jobs.router)
    app.include_router(models.router)
    app.include_router(tokens.router)
    app.include_router(usage.router)
    app.include_router(admin.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(webhooks.router)
    app.include_router(ui.router)

    @app.get("/metrics", include_in_schema=False)
    @costs.cheap
    async def metrics(_: AdminDep) -> Response:
        """Admin keys only: metrics name tenants' models, queue depths and error rates. A scraper on
        the private network uses SPOOL_API_METRICS_PORT instead."""
        return Response(generate_latest(_metrics_registry()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", include_in_schema=False)
    @costs.public
    async def health() -> dict:
        """The process is alive (what a liveness probe asks); /ready says whether it can serve."""
        return {"status": "ok"}

    @app.get("/ready", include_in_schema=False)
    @costs.public
    async def ready(request: Request) -> JSONResponse:
        """Postgres, Redis and at least one live worker per served model; 503 naming what is missing."""
        problems: list[str] = []
        models: dict[str, int] = {}
        try:
            async with asyncio.timeout(3), async_engine().connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception:
            problems.append("postgres unreachable")
        try:
            async with asyncio.timeout(3):
                await request.app.state.redis.ping()
                for m in settings.model_ids:
                    models[m] = len(await live_workers.live_async(request.app.state.redis, m))
        except Exception:
            problems.append("redis unreachable")
        for m in [m for m, n in models.items() if n == 0]:
            try:  # a worker that could not start left its reason (workers/__main__.py)
                failed = await live_workers.failures_async(request.app.state.redis, m)
            except Exception:
                failed = []
            why = f" (a worker could not start: {failed[0].error})" if failed else ""
            problems.append(f"no live worker for model '{m}'{why}")
        body = {"status": "ready" if not problems else "not ready", "problems": problems, "live_workers": models}
        return JSONResponse(body, status_code=503 if problems else 200)

    # FastAPI's own pages (the OpenAPI document and its viewers) charge nobody.
    for route in app.routes:
        if getattr(route, "path", None) in (
            app.openapi_url,
            app.docs_url,
            app.redoc_url,
            app.swagger_ui_oauth2_redirect_url,
        ):
            costs.public(route.endpoint)  # type: ignore[attr-defined]
    costs.check(app, settings)  # a route without a cost class, or declared against its code, stops the start here
    return app
