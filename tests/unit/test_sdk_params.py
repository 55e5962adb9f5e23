"""Every parameter the installed `openai` SDK declares has a decided answer (core/protocol/sdk_params.py),
and the request models and translations give that answer: accepted ones validate and translate, a
wrong type is a 400 naming the parameter, refused ones are a 400 naming it in the declaration's words.
The parameter lists come from the SDK's own TypedDicts, so a newer SDK's new key fails here until
it is decided."""

from __future__ import annotations

import importlib
import re
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from core.config import Settings
from core.errors import DomainError
from core.infra.tokenizers import tokenizer_for
from core.jobs.service import translate
from core.protocol import render, sdk_params
from core.protocol import responses as wire
from core.protocol.errors import from_validation
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from core.protocol.sdk_params import CHAT, COMPLETIONS, ENDPOINTS, RESPONSES, Answer
from tests.helpers import T0, response_job

MODEL = "smollm2-135m-instruct"
SETTINGS = Settings(n_ctx=1024)
DOC = Path(__file__).resolve().parents[2] / "docs" / "parameters.md"
MESSAGES = [{"role": "user", "content": "Hi"}]
FUNCTION = {"name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(MODEL)


def sdk_keys(module_name: str) -> set[str]:
    """Every key of the module's create-params TypedDicts (the streaming and non-streaming variants
    of its `...CreateParams` union: `stream` is declared only there)."""
    module = importlib.import_module(module_name)
    [union] = [getattr(module, n) for n in dir(module) if n.endswith("CreateParams")]
    keys: set[str] = set()
    for typed_dict in typing.get_args(union) or (union,):
        keys |= set(typing.get_type_hints(typed_dict))
    return keys


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_every_key_the_installed_sdk_declares_has_a_decided_answer(endpoint):
    decisions, module = ENDPOINTS[endpoint]
    keys = sdk_keys(module)
    assert len(keys) > 10  # the walk found the TypedDicts
    undecided = sorted(keys - set(decisions))
    assert not undecided, f"{endpoint}: decide these in core/protocol/sdk_params.py: {undecided}"
    gone = sorted(set(decisions) - keys)
    assert not gone, f"{endpoint}: the SDK no longer declares {gone}; drop them from core/protocol/sdk_params.py"
    for name, d in decisions.items():
        assert d.answer is not Answer.refused or d.refusal, name  # a refusal says why


def test_the_table_in_the_docs_is_the_declarations():
    text = DOC.read_text()
    m = re.search(r"<!-- sdk-params:begin -->\n(.*?)<!-- sdk-params:end -->", text, re.S)
    assert m is not None, "docs/parameters.md lacks the sdk-params markers"
    assert m.group(1) == sdk_params.markdown(), (
        "docs/parameters.md's SDK table is stale: paste `python -c 'from core.protocol.sdk_params import "
        'markdown; print(markdown(), end="")\'` between its sdk-params markers'
    )


# A legal value of each SDK parameter, and what it needs beside it. A key the SDK adds has none, and
# the tests below fail on it (KeyError) until it is decided and given one.
CHAT_LEGAL: dict[str, Any] = {
    "audio": {"format": "wav", "voice": "alloy"},
    "frequency_penalty": 0.5,
    "function_call": {"name": "get_weather"},
    "functions": [FUNCTION],
    "logit_bias": {"42": 1},
    "logprobs": True,
    "max_completion_tokens": 3,
    "max_tokens": 3,
    "messages": MESSAGES,
    "metadata": {"app": "spool-test"},
    "modalities": ["text"],
    "model": MODEL,
    "moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}},
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Hello"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "user-42",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "json_object"},
    "safety_identifier": "hashed-user",
    "seed": 7,
    "service_tier": "flex",
    "stop": ["\n"],
    "store": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "tool_choice": "required",
    "tools": [{"type": "function", "function": FUNCTION}],
    "top_logprobs": 2,
    "top_p": 0.5,
    "user": "u",
    "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
}
CHAT_NEEDS: dict[str, dict[str, Any]] = {
    "function_call": {"functions": [FUNCTION]},
    "stream_options": {"stream": True},
    "tool_choice": {"tools": [{"type": "function", "function": FUNCTION}]},
    "top_logprobs": {"logprobs": True},
}
COMPLETIONS_LEGAL: dict[str, Any] = {
    "best_of": 2,
    "echo": True,
    "frequency_penalty": 0.5,
    "logit_bias": {"42": 1},
    "logprobs": 2,
    "max_tokens": 3,
    "model": MODEL,
    "n": 1,
    "presence_penalty": 0.5,
    "prompt": "Hi",
    "seed": 7,
    "stop": ["\n"],
    "stream": True,
    "stream_options": {"include_usage": True},
    "suffix": "x",  # legal, and SmolLM2 has no FIM tokens: refused for the model, not the parameter
    "temperature": 0.5,
    "top_p": 0.5,
    "user": "u",
}
RESPONSES_LEGAL: dict[str, Any] = {
    "access_programs": {"cyber": "standard"},
    "background": True,
    "background_options": {"completion_window": "2h", "continuation_id": "c1"},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "conversation": "conv_1",
    "image": {"context_compression": "auto"},
    "include": ["message.output_text.logprobs"],
    "input": "Hi",
    "instructions": "Be terse.",
    "max_output_tokens": 3,
    "max_tool_calls": 2,
    "metadata": {"app": "spool-test"},
    "model": MODEL,
    "moderation": {"model": "omni-moderation-latest"},
    "parallel_tool_calls": False,
    "previous_response_id": "resp_0123456789abcdef01234567",
    "prompt": {"id": "pmpt_1"},
    "prompt_cache_key": "user-42",
    "prompt_cache_options": {"mode": "explicit", "ttl": "12h", "prewarm": False},
    "prompt_cache_retention": "in_memory",
    "reasoning": {},
    "safety_identifier": "hashed-user",
    "service_tier": "priority",
    "store": True,
    "stream": True,
    "stream_options": {"include_obfuscation": False},
    "temperature": 0.5,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [{"type": "function", **FUNCTION}],
    "top_logprobs": 2,
    "top_p": 0.5,
    "truncation": "auto",
    "user": "u",
}
RESPONSES_NEEDS: dict[str, dict[str, Any]] = {"stream_options": {"stream": True}}


def _chat_body(name: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, **CHAT_NEEDS.get(name, {}), name: CHAT_LEGAL[name]}


@pytest.mark.parametrize("name", sorted(sdk_keys(ENDPOINTS["/v1/chat/completions"][1])))
def test_chat_gives_each_sdk_parameter_its_answer(tok, name):
    req = ChatCompletionRequest.model_validate(_chat_body(name))
    assert req.unknown_fields() == [], f"{name} is not declared: it would be 'Unrecognized request argument'"
    if CHAT[name].answer is Answer.refused:
        with pytest.raises(DomainError) as e:
            translate(req, SETTINGS, tok)
        assert (e.value.param, e.value.code) == (name, "unsupported_parameter")
        assert e.value.message == sdk_params.refusal(CHAT, name)
    else:
        _, prompts, chat = translate(req, SETTINGS, tok)
        assert prompts and chat is not None


def test_every_accepted_chat_parameter_at_once(tok):
    body = {n: v for n, v in CHAT_LEGAL.items() if CHAT[n].answer is not Answer.refused}
    del body["functions"], body["function_call"]  # the legacy spelling of tools/tool_choice: one or the other
    body["tool_choice"] = "auto"  # a forced call is a constraint of its own, and response_format is another
    req = ChatCompletionRequest.model_validate(body)
    assert req.unknown_fields() == []
    params, _, chat = translate(req, SETTINGS, tok)
    assert (params.n, params.max_tokens, params.temperature, chat and chat["tools"]) == (2, 3, 0.5, True)


@pytest.mark.parametrize("name", sorted(sdk_keys(ENDPOINTS["/v1/completions"][1])))
def test_completions_honour_each_sdk_parameter(tok, name):
    assert COMPLETIONS[name].answer is Answer.honoured
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, name: COMPLETIONS_LEGAL[name]}
    if name == "stream_options":
        body["stream"] = True
    req = CompletionRequest.model_validate(body)
    assert req.unknown_fields() == []
    if name == "suffix":
        with pytest.raises(DomainError, match="fill-in-the-middle"):
            translate(req, SETTINGS, tok)
        return
    assert translate(req, SETTINGS, tok)[1]


@pytest.mark.parametrize("name", sorted(sdk_keys(ENDPOINTS["/v1/responses"][1])))
def test_responses_give_each_sdk_parameter_its_answer(name):
    body = {"model": MODEL, "input": "Hi", **RESPONSES_NEEDS.get(name, {}), name: RESPONSES_LEGAL[name]}
    req = wire.ResponsesRequest.model_validate(body)
    assert wire.unknown_fields(req) == [], f"{name} would be 'Unrecognized request argument'"
    if RESPONSES[name].answer is Answer.refused:
        with pytest.raises(DomainError) as e:
            wire.to_chat(req, [], MODEL)
        assert (e.value.param, e.value.code) == (name, "unsupported_parameter")
        assert e.value.message == sdk_params.refusal(RESPONSES, name)
    else:
        assert wire.to_chat(req, [], MODEL).messages


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("metadata", {"k": 1}),
        ("metadata", {f"k{i}": "v" for i in range(17)}),
        ("store", "yes"),
        ("service_tier", "turbo"),
        ("prompt_cache_key", 42),
        ("prompt_cache_retention", "1h"),
        ("prompt_cache_options", {"mode": "sometimes"}),
        ("safety_identifier", ["u"]),
        ("reasoning_effort", "extreme"),
        ("verbosity", 1),
        ("moderation", {"policy": {}}),
        ("prediction", {"type": "diff", "content": "x"}),
        ("modalities", "text"),
        ("modalities", ["video"]),
        ("functions", [{"description": "no name"}]),
        ("function_call", "required"),
        ("audio", "wav"),
        ("web_search_options", True),
    ],
)
def test_a_wrong_type_is_a_400_naming_the_chat_parameter(name, value):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, name: value})
    assert (from_validation(e.value.errors()).param or "").split(".")[0] == name


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("service_tier", "turbo"),
        ("prompt_cache_retention", "forever"),
        ("prompt_cache_options", {"ttl": "1d"}),
        ("moderation", {"model": 1}),
        ("background_options", {"completion_window": "1h"}),
        ("access_programs", {"cyber": "red"}),
        ("image", {"context_compression": "yes"}),
    ],
)
def test_a_wrong_type_is_a_400_naming_the_responses_parameter(name, value):
    with pytest.raises(ValidationError) as e:
        wire.ResponsesRequest.model_validate({"model": MODEL, "input": "x", name: value})
    assert (from_validation(e.value.errors()).param or "").split(".")[0] == name


def test_modalities_text_is_accepted_and_audio_refused_saying_why(tok):
    translate(ChatCompletionRequest.model_validate(_chat_body("modalities")), SETTINGS, tok)
    req = ChatCompletionRequest.model_validate({**_chat_body("modalities"), "modalities": ["text", "audio"]})
    with pytest.raises(DomainError) as e:
        translate(req, SETTINGS, tok)
    assert e.value.param == "modalities" and "text only" in e.value.message


def test_legacy_functions_are_tools_and_function_call_is_tool_choice(tok):
    named = ChatCompletionRequest.model_validate(_chat_body("function_call"))
    params, _, chat = translate(named, SETTINGS, tok)
    assert chat == {"tools": True, "top_logprobs": None, "forced": ["get_weather"]} and params.grammar is not None
    for call, parsed in (("auto", True), ("none", False), (None, True)):
        body = {**_chat_body("functions"), **({"function_call": call} if call else {})}
        params, prompts, chat = translate(ChatCompletionRequest.model_validate(body), SETTINGS, tok)
        assert chat is not None and chat["tools"] is parsed and params.grammar is None
        described = "get_weather" in tok.decode(prompts[0].ids)  # offered to the model as a tool is
        assert described is parsed
    assert ChatCompletionRequest.model_validate(_chat_body("functions")).constrained()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"function_call": "auto"}, "function_call"),
        ({"functions": [FUNCTION], "function_call": {"name": "other"}}, "function_call"),
        ({"functions": [FUNCTION], "tools": CHAT_LEGAL["tools"]}, "functions"),
    ],
)
def test_legacy_functions_misused_name_the_parameter(tok, extra, param):
    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, **extra})
    with pytest.raises(DomainError) as e:
        translate(req, SETTINGS, tok)
    assert e.value.param == param


def test_a_prewarm_is_refused_saying_why():
    req = wire.ResponsesRequest.model_validate(
        {"model": MODEL, "input": "x", "prompt_cache_options": {"prewarm": True}}
    )
    with pytest.raises(DomainError) as e:
        wire.to_chat(req, [], MODEL)
    assert e.value.param == "prompt_cache_options.prewarm" and "without generating" in e.value.message


def test_chat_fields_stay_off_the_responses_request():
    req = wire.ResponsesRequest.model_validate(
        {"model": MODEL, "input": "x", "functions": [FUNCTION], "verbosity": "low"}
    )
    assert wire.unknown_fields(req) == ["functions", "verbosity"]


def test_the_tier_that_served_is_echoed_default_from_one_place():
    job = SimpleNamespace(
        id="cmpl-0123456789abcdef01234567",
        model=MODEL,
        created_at=T0,
        params={},
        chat={"tools": False, "top_logprobs": None},
        result={"choices": [{"index": 0, "text": "Hi", "finish_reason": "stop"}]},
        usage={"prompt_tokens": 3, "completion_tokens": 1},
    )
    assert render.chat_completion(job, "fp_x")["service_tier"] == "default"
    assert render.ChatChunks(job, include_usage=False, fingerprint="fp_x").base["service_tier"] == "default"
    asked_flex = response_job("succeeded", job.result, job.usage, service_tier="flex")
    assert render.response_of(asked_flex)["service_tier"] == "default"
