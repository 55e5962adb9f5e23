"""GET /v1/models and /v1/models/{id} (also under Llama Stack's /v1/openai/v1/)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from api.costs import cheap
from api.deps import RedisDep, SettingsDep, TenantDep
from api.errors import APIError
from core.config import Settings
from core.errors import DomainError
from core.infra.tokenizers import context_length, tokenizer_for
from core.jobs import live_workers
from core.protocol import render
from core.protocol.schemas import ModelList, ModelObject
from core.registry import aliases, resolve, served_models, settings_for

router = APIRouter()


async def _model(name: str, model_id: str, settings: Settings, redis) -> dict:
    ms = settings_for(model_id, settings)
    try:
        ctx = context_length(await anyio.to_thread.run_sync(tokenizer_for, model_id), ms)
    except DomainError:  # its weights are not on this host: listed with its configured context
        ctx = ms.n_ctx
    return render.model(name, model_id, ctx, len(await live_workers.live_async(redis, model_id)))


@router.get("/v1/models", response_model=ModelList)
@router.get("/v1/openai/v1/models", response_model=ModelList, include_in_schema=False)  # Llama Stack's path
@cheap
async def list_models(_: TenantDep, settings: SettingsDep, redis: RedisDep) -> dict:
    names = [(m, m) for m in served_models(settings)] + list(aliases(settings).items())
    return render.listing([await _model(n, m, settings, redis) for n, m in names])


@router.get("/v1/models/{model_id:path}", response_model=ModelObject)
@router.get("/v1/openai/v1/models/{model_id:path}", response_model=ModelObject, include_in_schema=False)
@cheap
async def get_model(model_id: str, _: TenantDep, settings: SettingsDep, redis: RedisDep) -> dict:
    served = resolve(model_id, settings)
    if served is None:
        raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
    return await _model(model_id, served, settings, redis)
