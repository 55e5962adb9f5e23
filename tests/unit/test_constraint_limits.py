"""Limits on constraints: a constraint too large to compile is a 400 naming its parameter, decided
from the request's values before anything is compiled (compiles are counted, not timed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher

from core.config import Settings
from core.errors import DomainError
from core.generation import constraints
from core.generation.constraints import LLGUIDANCE_MAX_CHOICES, ConstraintError, Limits, build, check
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from core.protocol.translate import chat_to_generation, compile_constraint, to_generation

SETTINGS = Settings(database_url="postgresql+psycopg://x@127.0.0.1/none", redis_url="redis://127.0.0.1:1/0")


class CountingLLMatcher:
    """llguidance's LLMatcher with every grammar construction and validation counted."""

    calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(LLMatcher, name)

        def counted(*a: Any, **k: Any) -> Any:
            self.calls.append(name)
            return real(*a, **k)

        return counted


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    spy = CountingLLMatcher()
    spy.calls = []
    monkeypatch.setattr(constraints, "LLMatcher", spy)
    return spy.calls


class Tok:
    n_vocab = 100
    train_context = 512
    eos = 0

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        return [10 + ord(c) % 50 for c in text]

    def fim_tokens(self) -> None:
        return None


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


TOO_LARGE = [
    ({"guided_choice": [f"c{i}" for i in range(LLGUIDANCE_MAX_CHOICES + 1)]}, "guided_choice", "2000 entries"),
    ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "guided_choice", "100000 entries"),
    ({"guided_choice": ["x" * 1000] * 100}, "guided_choice", "100000 bytes"),
    ({"grammar": 'root ::= "' + "a" * 70_000 + '"'}, "grammar", "the grammar"),
    ({"grammar": {"type": "lark", "value": 'start: "' + "a" * 70_000 + '"'}}, "grammar", "the grammar"),
    ({"grammar": {"type": "regex", "value": "a" * 5000}}, "grammar", "the regex"),
    ({"grammar": {"type": "json_schema", "value": nested(40)}}, "grammar", "nesting"),
    ({"regex": "a" * 5000}, "regex", "5000 bytes"),
    ({"json_schema": {"enum": ["v" * 100] * 1000}}, "json_schema", "the JSON schema"),
    ({"json_schema": json.dumps({"enum": ["v" * 100] * 1000})}, "json_schema", "the JSON schema"),
    ({"json_schema": nested(40)}, "json_schema", "nesting"),
    ({"json_schema": "[" * 60_000}, "json_schema", "nesting"),  # measured without parsing (no recursion)
    ({"response_format": {"type": "json_object", "schema": nested(40)}}, "response_format", "nesting"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["v" * 100] * 1000}}}},
        "response_format",
        "the JSON schema",
    ),
]


@pytest.mark.parametrize(("kw", "param", "says"), TOO_LARGE)
def test_a_constraint_over_its_limit_is_refused_naming_it_before_any_compile(compiles, kw, param, says):
    for f in (check, build):
        with pytest.raises(ConstraintError) as err:
            f(**kw)
        assert err.value.param == param and says in str(err.value)
    assert compiles == []


def test_the_choice_limit_is_what_llguidance_accepts(compiles):
    """1,999 choices build and run in llguidance's parser; 2,000 passed the old validation and then
    failed at the first token ("Current row has 2001 items; max is 2000")."""
    assert build(guided_choice=[f"choice {i}" for i in range(LLGUIDANCE_MAX_CHOICES)]) is not None
    assert compiles  # it compiled: within the limit
    with pytest.raises(ValueError):
        Settings(max_guided_choices=LLGUIDANCE_MAX_CHOICES + 1)


def test_limits_are_settings():
    small = Limits(choices=3, choice_bytes=10, regex_bytes=3, schema_depth=3)
    with pytest.raises(ConstraintError, match="4 entries; the limit is 3"):
        check(guided_choice=["a", "b", "c", "d"], limits=small)
    with pytest.raises(ConstraintError, match="the limit is 10"):
        check(guided_choice=["aaaaaa", "bbbbbb"], limits=small)
    with pytest.raises(ConstraintError):
        check(regex="abcd", limits=small)
    with pytest.raises(ConstraintError):
        check(json_schema=nested(2), limits=small)  # 5 levels: object, properties, object, ...
    assert check(json_schema=nested(1), limits=small) == ("json_schema", nested(1))
    assert check() is None


def test_the_translation_refuses_before_compiling(compiles):
    req = CompletionRequest(model="m", prompt="hi", guided_choice=[str(i) for i in range(2001)])
    with pytest.raises(DomainError) as err:
        to_generation(req, SETTINGS, Tok())
    assert err.value.param == "guided_choice" and err.value.code == "invalid_constraint"
    assert compiles == []
    few = SETTINGS.model_copy(update={"max_guided_choices": 5})
    req = CompletionRequest(model="m", prompt="hi", guided_choice=[str(i) for i in range(6)])
    with pytest.raises(DomainError, match="the limit is 5"):
        to_generation(req, few, Tok())
    assert compiles == []


def test_a_deferred_translation_checks_but_compiles_later(compiles):
    req = CompletionRequest(model="m", prompt="hi", guided_choice=["yes", "no"])
    params, _ = to_generation(req, SETTINGS, Tok(), compile=False)
    assert params.grammar is None and compiles == []
    grammar = compile_constraint(req, SETTINGS)
    assert grammar and compiles
    eager, _ = to_generation(req, SETTINGS, Tok())
    assert eager.grammar == grammar
    # An empty value costs nothing: refused at once even when compiling is deferred.
    with pytest.raises(DomainError) as err:
        to_generation(CompletionRequest(model="m", prompt="hi", guided_choice=[]), SETTINGS, Tok(), compile=False)
    assert err.value.param == "guided_choice"


def test_a_forced_tool_calls_schemas_are_held_to_the_schema_limits(compiles):
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(40)}}
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="required"
    )
    with pytest.raises(DomainError) as err:
        compile_constraint(req, SETTINGS)
    assert err.value.param == "tools" and "nesting" in err.value.message
    assert compiles == []
    with pytest.raises(DomainError) as err:
        chat_to_generation(req, SETTINGS, Tok(), "{{ messages }}")
    assert err.value.param == "tools" and compiles == []
