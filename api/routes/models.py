"""GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from api.deps import SettingsDep, TenantDep
from api.errors import APIError
from core.config import Settings
from core.infra.tokenizers import context_length, tokenizer_for
from core.protocol.schemas import ModelList, ModelObject
from core.registry import ModelSpec, served_models

router = APIRouter(prefix="/v1/models")
_CREATED = 1735689600  # fixed: the model list is configuration, not a dated object


async def _model(spec: ModelSpec, settings: Settings) -> dict:
    tok = await anyio.to_thread.run_sync(tokenizer_for, spec.id)
    return {
        "id": spec.id,
        "object": "model",
        "created": _CREATED,
        "owned_by": spec.owned_by,
        "context_length": context_length(tok, settings),
    }


@router.get("", response_model=ModelList)
async def list_models(_: TenantDep, settings: SettingsDep) -> dict:
    return {"object": "list", "data": [await _model(m, settings) for m in served_models(settings).values()]}


@router.get("/{model_id:path}", response_model=ModelObject)
async def get_model(model_id: str, _: TenantDep, settings: SettingsDep) -> dict:
    spec = served_models(settings).get(model_id)
    if spec is None:
        raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
    return await _model(spec, settings)
