"""POST /tokenize and /detokenize in llama.cpp's shapes (plus an optional `model`)."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from api.bodies import json_body, openapi_body
from api.deps import SettingsDep, TenantDep
from api.errors import APIError
from core.config import Settings
from core.infra.tokenizers import Tokenizer, tokenizer_for
from core.protocol.schemas import DetokenizeResponse, TokenizeResponse
from core.registry import resolve, served_models

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str
    add_special: bool = False
    with_pieces: bool = False
    model: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[Annotated[int, Field(ge=0)]]
    model: str | None = None


async def _tokenizer(model: str | None, settings: Settings) -> Tokenizer:
    served = resolve(model, settings) if model else next(iter(served_models(settings)))
    if served is None:
        raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
    return await anyio.to_thread.run_sync(tokenizer_for, served)


# Bodies decoded and validated off the event loop (api/bodies.py): a million token ids is a big list.
_Tokenize = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
_Detokenize = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]


@router.post("/tokenize", response_model=TokenizeResponse, openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(body: _Tokenize, _: TenantDep, settings: SettingsDep) -> dict:
    tok = await _tokenizer(body.model, settings)

    def work() -> dict:  # a long text takes a while: never on the event loop
        ids = tok.encode(body.content, add_special=body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": tok.token_text(t)} for t in ids]}
        return {"tokens": ids}

    return await anyio.to_thread.run_sync(work)


@router.post("/detokenize", response_model=DetokenizeResponse, openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(body: _Detokenize, _: TenantDep, settings: SettingsDep) -> dict:
    tok = await _tokenizer(body.model, settings)
    bad = [t for t in body.tokens if t >= tok.n_vocab]
    if bad:
        raise APIError(
            400, f"Token id {bad[0]} is out of range (0..{tok.n_vocab - 1}).", param="tokens", code="invalid_value"
        )
    return {"content": await anyio.to_thread.run_sync(tok.decode, body.tokens)}
