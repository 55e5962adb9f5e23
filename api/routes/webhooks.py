"""The calling tenant's webhook signing secret: read it (made on first use) or rotate it."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from api.costs import cheap
from api.deps import LifecycleDep, TenantDep
from core.batches import webhooks
from core.protocol import render
from core.protocol.schemas import WebhookSecret

router = APIRouter(prefix="/v1/webhooks/secret")


@router.get("", response_model=WebhookSecret)
@cheap
async def get_secret(tenant: TenantDep, lifecycle: LifecycleDep) -> dict:
    secret = await anyio.to_thread.run_sync(webhooks.tenant_secret, lifecycle.sessions, tenant.id)
    return render.webhook_secret(secret)


@router.post("", response_model=WebhookSecret)
@cheap
async def rotate_secret(tenant: TenantDep, lifecycle: LifecycleDep) -> dict:
    """A new secret; deliveries from now on are signed with it alone."""
    secret = await anyio.to_thread.run_sync(lambda: webhooks.tenant_secret(lifecycle.sessions, tenant.id, rotate=True))
    return render.webhook_secret(secret)
