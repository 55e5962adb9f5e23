"""api/bodies.py validates with a copy of each request model whose list items yield the GIL: that copy
must accept, produce and refuse exactly what the model itself does (whatever core/protocol/schemas
grows), and the body must be validated on a thread, not the event loop."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from api import bodies
from api.bodies import _original_label, openapi_body, parse, ticking
from api.routes.tokens import DetokenizeRequest, TokenizeRequest
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from tests.helpers import threads_of

P, C = CompletionRequest, ChatCompletionRequest
CASES: list[tuple[type[BaseModel], object]] = [
    (P, {"model": "m", "prompt": "x", "n_predict": 3, "logit_bias": {"1": 2}, "stop": ["a"]}),
    (P, {"model": "m", "prompt": [[1, 2], "a", 3]}),
    (P, {"model": "m", "prompt": [1, 2, -1]}),
    (P, {"model": "m", "prompt": [1.5]}),
    (P, {"model": "m", "prompt": [[1], []]}),
    (P, {"model": "m", "prompt": []}),
    (P, {"model": "m", "prompt": [["a", None]]}),
    (P, {"model": "m", "prompt": [{}]}),
    (P, {"prompt": "x"}),
    (P, {"model": "m", "prompt": "x", "logit_bias": {"1": 500}}),
    (P, {"model": "m", "prompt": "x", "logit_bias": {"1": "a"}}),
    (P, {"model": "m", "prompt": "x", "stop": ["a"] * 17}),
    (P, {"model": "m", "prompt": "x", "stop": [1]}),
    (P, {"model": "m", "prompt": "x", "tools": [{"type": "x"}]}),
    (P, {"model": "m", "prompt": "x", "dry_sequence_breakers": ["a" * 65]}),
    (P, {"model": "m", "prompt": "x", "images": [1]}),
    (P, {"model": "m", "prompt": "x", "max_tokens": "5"}),
    (P, {"model": "m", "prompt": "x", "guided_choice": [None]}),
    (P, {"model": "m", "prompt": "x", "temperature": float("nan")}),
    (P, {"model": "m", "prompt": "x", "logprobs": 7}),
    (P, [1]),
    (P, "x"),
    (P, b'{"a": 1}'),
    (P, None),
    (C, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "extra": 1}),
    (C, {"model": "m", "messages": []}),
    (C, {"model": "m", "messages": [{"role": "x"}]}),
    (C, {"model": "m", "messages": [{"role": "user", "content": []}]}),
    (C, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (C, {"model": "m", "messages": [{"role": "user", "content": 1}]}),
    (C, {"model": "m", "messages": [{"role": "user", "tool_calls": [{"id": "a"}] * 129}]}),
    (C, {"model": "m", "messages": [{"role": "user", "content": "x", "bogus": 1}]}),
    (C, {"model": "m", "messages": "hi"}),
    (C, {"model": 1, "messages": [{"role": "user"}] * 3}),
    (DetokenizeRequest, {"tokens": [1, 2, 3]}),
    (DetokenizeRequest, {"tokens": [1, -2, "3"]}),
    (TokenizeRequest, {"content": "x", "with_pieces": 1}),
]


def _outcome(model: type[BaseModel], value: object) -> tuple[str, object]:
    try:
        return "ok", model.model_validate(value).model_dump(mode="json", exclude_unset=True)
    except ValidationError as e:
        return "error", [{**err, "loc": tuple(map(_original_label, err["loc"]))} for err in e.errors(include_url=False)]


@pytest.mark.parametrize(("model", "value"), CASES)
def test_ticking_copy_validates_like_the_model(model, value):
    assert repr(_outcome(ticking(model), value)) == repr(_outcome(model, value))


def test_ticking_copy_is_the_model():
    for model in (P, C, DetokenizeRequest, TokenizeRequest):
        copy = ticking(model)
        assert issubclass(copy, model) and copy.__name__ == model.__name__
        assert copy.model_json_schema() == model.model_json_schema()


def test_parse_raises_what_fastapi_raises():
    with pytest.raises(RequestValidationError) as missing:
        parse(P, b"", "application/json")
    assert missing.value.errors()[0]["type"] == "missing" and missing.value.errors()[0]["loc"] == ("body",)
    with pytest.raises(RequestValidationError) as broken:
        parse(P, b'{"model": ', "application/json")
    assert broken.value.errors()[0]["type"] == "json_invalid" and broken.value.errors()[0]["loc"] == ("body", 10)
    with pytest.raises(HTTPException):
        parse(P, b"\xff\xfe\xfa", "application/json")
    with pytest.raises(RequestValidationError) as not_json:  # not declared JSON: validated as bytes
        parse(P, b'{"model": "m", "prompt": "x"}', "text/plain")
    assert not_json.value.errors()[0]["loc"] == ("body",)
    with pytest.raises(RequestValidationError) as bad:
        parse(C, json.dumps({"model": "m", "messages": [{"role": "user", "content": 1}]}).encode(), "application/json")
    assert bad.value.errors()[0]["loc"][:4] == ("body", "messages", 0, "content")
    body = parse(P, b'{"model": "m", "prompt": [1, 2]}', "application/vnd.api+json; charset=utf-8")
    assert isinstance(body, P) and body.prompt == [1, 2]


def test_openapi_body_is_the_models_schema_without_refs():
    doc = json.dumps(openapi_body(C))
    assert "$ref" not in doc and '"ChatMessage"' in doc  # nested models inlined, titles kept


def _body_via_dependency(model, raw: bytes, monkeypatch) -> tuple[object, list[int]]:
    """`json_body(model)` run on `raw`; returns its answer (or the exception) and the threads that parsed it."""
    seen = threads_of(monkeypatch, bodies, "_parse")

    class FakeRequest:
        headers = {"content-type": "application/json"}

        async def body(self) -> bytes:
            return raw

    async def main() -> object:
        try:
            return await bodies.json_body(model)(FakeRequest())  # type: ignore[arg-type]
        except RequestValidationError as e:
            return e

    return asyncio.run(main()), seen


def test_a_big_body_is_validated_on_a_thread_and_a_small_one_on_the_loop(monkeypatch):
    big = json.dumps({"model": "m", "prompt": "x" * (bodies.INLINE_BYTES + 1)}).encode()
    got, seen = _body_via_dependency(P, big, monkeypatch)
    assert isinstance(got, P) and seen and seen[0] != threading.get_ident()
    got, seen = _body_via_dependency(P, b'{"model": "m", "prompt": "x"}', monkeypatch)
    assert isinstance(got, P) and seen == [threading.get_ident()]


@pytest.mark.parametrize(
    "bad",
    [
        {"model": "m", "messages": [{"role": "user", "content": 1}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        {"model": "m", "messages": "hi"},
        {"messages": [{"role": "user", "content": "x"}]},
    ],
)
def test_small_and_big_bodies_get_the_same_errors(monkeypatch, bad):
    small = json.dumps(bad).encode()
    big = json.dumps({**bad, "user": "u" * bodies.INLINE_BYTES}).encode()  # same fault, past the inline size
    (on_loop, _), (on_thread, _) = (
        _body_via_dependency(C, small, monkeypatch),
        _body_via_dependency(C, big, monkeypatch),
    )
    assert isinstance(on_loop, RequestValidationError) and isinstance(on_thread, RequestValidationError)
    strip = lambda e: [{k: v for k, v in err.items() if k != "input"} for err in e.errors()]  # noqa: E731
    assert strip(on_loop) == strip(on_thread)


# Edges where parsers differ: jiter must give json.loads's value exactly or refuse (then json.loads decides).
JSON_EDGES = [
    b'{"a": "x\x01y"}',
    b"[NaN, Infinity, -Infinity]",
    b"[1e400, -1e400, 5e-324, 1.7976931348623157e308, 0.1, 1E2, 1.0, -0, -0.0]",
    b"123456789012345678901234567890",
    b'{"a": 1, "a": 2}',
    b'"\\ud800"',
    b"\xef\xbb\xbf{}",
    '{"a": "é"}'.encode("utf-16"),
    b' \t\n{"b": [true, false, null]} ',
    b"{} x",
    b"[1,]",
    b'"\\u0000"',
    b'"\xff"',
    b"1" + b"0" * 5000,
    b"[" * 500 + b"]" * 500,
]


@pytest.mark.parametrize("raw", JSON_EDGES)
def test_fast_decode_gives_json_loads_answer(raw):
    def outcome(fn):
        try:
            return "ok", repr(fn(raw))
        except Exception as e:  # the exception's kind is what FastAPI's handler words
            return "error", type(e).__name__

    assert outcome(bodies._loads) == outcome(json.loads)


def test_deeply_nested_body_is_a_400_not_a_crash():
    deep = b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(RequestValidationError) as e:
        parse(P, deep, "application/json")
    assert e.value.errors()[0]["type"] == "json_invalid"
