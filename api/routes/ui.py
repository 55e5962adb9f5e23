"""The status page at /ui, for admin keys: models and their live workers and queues, running jobs,
batches with a progress bar and ETA, per-tenant usage over the last 24 hours. Server-rendered
(Jinja, inline SVG charts): no JavaScript, nothing fetched from a CDN; it refreshes itself.

Login: an admin key posted once becomes a random session id in an HttpOnly, SameSite=Strict cookie;
Redis keeps only the key's SHA-256 digest (8 h), never the key itself, and the key is checked by
it on every view, so a revoked key is out at once."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from api.costs import public
from api.deps import AsyncSessionsDep, RedisDep, SettingsDep, SyncRedisDep, SyncSessionsDep
from api.guard import authenticate
from core.errors import DomainError
from core.infra import redis_keys
from core.states import KeyScope
from core.status_page import Snapshot, snapshot
from core.tenancy.keys import hash_key, is_live_admin

router = APIRouter(prefix="/ui", include_in_schema=False)
COOKIE = "spool_ui"
SESSION_S = 8 * 3600
PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d"]

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
_env = Environment(
    loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True), trim_blocks=True, lstrip_blocks=True
)


async def _admin_key(request: Request, redis, sessions) -> str | None:
    """The digest of the live admin key behind the session cookie, or None."""
    token = request.cookies.get(COOKIE)
    if not token or len(token) > 64:
        return None
    digest = await redis.get(redis_keys.ui_session(token))
    if digest is None:
        return None
    digest = digest if isinstance(digest, str) else digest.decode()
    if await redis.exists(redis_keys.revoked(digest)):
        return None
    return digest if await is_live_admin(sessions, digest) else None


@router.get("", response_class=HTMLResponse)
@public
async def page(
    request: Request,
    redis: RedisDep,
    settings: SettingsDep,
    sessions: AsyncSessionsDep,
    sync_sessions: SyncSessionsDep,
    sync_redis: SyncRedisDep,
) -> Response:
    if await _admin_key(request, redis, sessions) is None:
        return HTMLResponse(_env.get_template("login.html").render(error=request.query_params.get("error")))
    snap = await anyio.to_thread.run_sync(snapshot, sync_sessions, sync_redis, settings.model_ids)
    page = _env.get_template("status.html")
    refresh = request.query_params.get("refresh", "5")  # seconds; 0 = no self-refresh
    every = min(int(refresh), 3600) if refresh.isascii() and refresh.isdigit() and len(refresh) < 8 else 5
    return HTMLResponse(page.render(s=snap, chart=usage_chart(snap), fmt=_fmt, refresh=every))


@router.get("/style.css")
@public
async def style() -> Response:
    return Response((TEMPLATES / "style.css").read_text(), media_type="text/css")


@router.post("/login")
@public
async def login(redis: RedisDep, sessions: AsyncSessionsDep, key: str = Form(..., max_length=256)) -> Response:
    try:
        principal = await authenticate(f"Bearer {key}", redis, sessions)
    except DomainError:
        principal = None
    if principal is None or principal.key.scope != KeyScope.admin:
        return RedirectResponse("/ui?error=1", status_code=303)
    token = secrets.token_urlsafe(32)
    await redis.set(redis_keys.ui_session(token), hash_key(key), ex=SESSION_S)  # never the key itself
    resp = RedirectResponse("/ui", status_code=303)
    resp.set_cookie(COOKIE, token, max_age=SESSION_S, httponly=True, samesite="strict", path="/ui")
    return resp


@router.post("/logout")
@public
async def logout(request: Request, redis: RedisDep) -> Response:
    token = request.cookies.get(COOKIE)
    if token:
        await redis.delete(redis_keys.ui_session(token))
    resp = RedirectResponse("/ui", status_code=303)
    resp.delete_cookie(COOKIE, path="/ui")
    return resp


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60}m" if s >= 3600 else f"{s // 60}m {s % 60}s" if s >= 60 else f"{s}s"


def usage_chart(snap: Snapshot, width: int = 720, height: int = 180) -> dict[str, Any]:
    """Stacked bars of tokens per hour per tenant, as SVG geometry the template draws."""
    totals = [sum(v[i] for v in snap.usage.values()) for i in range(len(snap.hours))]
    peak = max(totals, default=0) or 1
    bar_w = width / max(len(snap.hours), 1)
    bars: list[dict[str, Any]] = []
    legend = []
    base = [0.0] * len(snap.hours)
    for n, (tenant, series) in enumerate(sorted(snap.usage.items())):
        color = PALETTE[n % len(PALETTE)]
        legend.append({"tenant": tenant, "color": color, "total": sum(series)})
        for i, v in enumerate(series):
            if not v:
                continue
            h = v / peak * (height - 20)
            base[i] += h
            bars.append(
                {
                    "x": i * bar_w + 1,
                    "y": height - base[i],
                    "w": bar_w - 2,
                    "h": h,
                    "color": color,
                    "title": f"{tenant}: {v}",
                }
            )
    ticks = [{"x": i * bar_w, "label": h.strftime("%H:%M")} for i, h in enumerate(snap.hours) if i % 4 == 0]
    return {"width": width, "height": height, "bars": bars, "legend": legend, "ticks": ticks, "peak": peak}
