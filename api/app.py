"""The FastAPI application: routes, error shapes, body limit, health."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import anyio
import redis
import redis.asyncio as aioredis
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api import errors
from api.routes import admin, batches, completions, files, jobs, models, tokens, usage
from core.config import get_settings
from core.infra.db import async_engine, sync_sessions
from core.infra.tokenizers import tokenizer_for
from core.jobs.lifecycle import Lifecycle

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings = get_settings()
    app.state.redis = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    # Jobs end through the one sync lifecycle (also the worker's and dispatcher's), run in a thread.
    app.state.lifecycle = Lifecycle(sync_sessions(), redis.Redis.from_url(settings.redis_url), settings)
    for model in settings.model_ids:  # load tokenizers now, not on the first request
        await anyio.to_thread.run_sync(tokenizer_for, model)
    yield
    await app.state.redis.aclose()
    await async_engine().dispose()


def create_app() -> FastAPI:
    settings = get_settings()
    app = FastAPI(
        title="Spool", version="0.1.0", lifespan=lifespan, description="Queue-backed, OpenAI-compatible completions."
    )
    errors.install(app)

    @app.middleware("http")
    async def body_limit(request: Request, call_next):
        length = request.headers.get("content-length")
        limit = settings.max_file_bytes + (1 << 20) if request.url.path == "/v1/files" else settings.max_body_bytes
        if length and length.isdigit() and int(length) > limit:
            return errors.error_response(
                errors.APIError(
                    413,
                    f"Request body too large: {length} bytes (limit {limit}).",
                    code="request_too_large",
                )
            )
        return await call_next(request)

    app.include_router(completions.router)
    app.include_router(jobs.router)
    app.include_router(models.router)
    app.include_router(tokens.router)
    app.include_router(usage.router)
    app.include_router(admin.router)
    app.include_router(files.router)
    app.include_router(batches.router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", include_in_schema=False)
    async def health(request: Request) -> dict:
        await request.app.state.redis.ping()
        async with async_engine().connect() as conn:
            await conn.execute(text("SELECT 1"))
        return {"status": "ok"}

    return app
