"""POST /tokenize and /detokenize in llama.cpp's shapes (plus an optional `model`), built by core/protocol/render.py."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field

from api.bodies import json_body, json_response, openapi_body
from api.costs import work
from api.deps import SettingsDep, TenantDep
from api.errors import APIError
from core.config import Settings
from core.infra.tokenizers import Tokenizer, tokenizer_for
from core.protocol import render
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


# `with_pieces` answers each token with its text: 2M tokens of an 8 MiB body made ~100 MiB of JSON (and
# held an API process 9 s). At most this many tokens come back with pieces (a 400 above it); without
# pieces, the ids of any body the size limit lets through.
MAX_PIECES = 131_072


def _too_many(n: int, at_least: bool = False) -> APIError:
    return APIError(
        400,
        f"The content is {'at least ' if at_least else ''}{n} tokens: with_pieces answers at most {MAX_PIECES}. "
        "Send it in parts, or without with_pieces.",
        param="with_pieces",
        code="too_many_tokens",
    )


# The bound is checked before the work it bounds (issue 49: an 8 MiB body was refused only after 4-5 s
# of tokenizing): the text is counted a slice at a time, cut at spaces, and refused as soon as the
# slices alone pass the bound, so a refusal costs at most MAX_PIECES tokens' worth of tokenizing.
_SLICE_CHARS = 32 * 1024
_EDGE_TOKENS = 2  # what a cut at a space may add to a count (the pieces on either side of it)


def _refuse_past_bound(tok: Tokenizer, text: str) -> None:
    counted, start, slices = 0, 0, 0
    while start < len(text):
        end = min(len(text), start + _SLICE_CHARS)
        if end < len(text):
            space = text.rfind(" ", start + 1, end)
            end = space if space > start else end
        counted += len(tok.encode(text[start:end], add_special=False))
        slices += 1
        start = end
        if counted - _EDGE_TOKENS * slices > MAX_PIECES:
            raise _too_many(counted - _EDGE_TOKENS * slices, at_least=True)


def tokenized(tok: Tokenizer, body: TokenizeRequest) -> dict:
    """The /tokenize answer. Blocking (a long text takes a while): run it off the event loop."""
    if body.with_pieces:
        _refuse_past_bound(tok, body.content)
    ids = tok.encode(body.content, add_special=body.add_special)
    if not body.with_pieces:
        return render.tokens(ids)
    if len(ids) > MAX_PIECES:
        raise _too_many(len(ids))
    return render.tokens(ids, [tok.token_text(t) for t in ids])


@router.post("/tokenize", response_model=TokenizeResponse, openapi_extra=openapi_body(TokenizeRequest))
@work
async def tokenize(body: _Tokenize, _: TenantDep, settings: SettingsDep) -> Response:
    """Tokenized, built and encoded on the prepare threads (api/bodies.json_response). With
    `with_pieces`, at most MAX_PIECES (131,072) tokens."""
    return await json_response(tokenized, await _tokenizer(body.model, settings), body)


def detokenized(tok: Tokenizer, body: DetokenizeRequest) -> dict:
    """The /detokenize answer. Blocking (a million ids to check and decode): run it off the event loop."""
    bad = next((t for t in body.tokens if t >= tok.n_vocab), None)
    if bad is not None:
        raise APIError(
            400, f"Token id {bad} is out of range (0..{tok.n_vocab - 1}).", param="tokens", code="invalid_value"
        )
    return render.detokenized(tok.decode(body.tokens))


@router.post("/detokenize", response_model=DetokenizeResponse, openapi_extra=openapi_body(DetokenizeRequest))
@work
async def detokenize(body: _Detokenize, _: TenantDep, settings: SettingsDep) -> Response:
    return await json_response(detokenized, await _tokenizer(body.model, settings), body)
