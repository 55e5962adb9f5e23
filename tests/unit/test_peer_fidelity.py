"""Issue 38: what the peers' own test suites still found. Chat text parts joined as llama.cpp and vLLM
join them, llama.cpp's `logit_bias` forms, a forced tool call cut inside an argument holding
"</tool_call>", tool-call grammars that admit only declared keys, and OpenAI's `strict` schemas."""

from __future__ import annotations

import json
import math

import pytest
from llguidance import LLMatcher

from core.errors import DomainError
from core.generation import chat_template, constraints
from core.generation.params import GenerationParams
from core.infra.tokenizers import tokenizer_for
from core.protocol.schemas import ChatMessage
from core.protocol.translate import LOGIT_BIAS_TEXT_BYTES
from tests.unit.test_translate import MODEL, chat, translate
from workers.engine.llamacpp import sampler_plan


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(MODEL)


def _completion(tok, **kw):
    return translate(tok, **kw)[0]


# -- chat text parts ------------------------------------------------------------------------------
def test_text_parts_are_joined_by_a_newline_as_llama_cpp_and_vllm_join_them():
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]
    assert ChatMessage.model_validate({"role": "user", "content": parts}).text() == "What is\nthe best book"
    # llama.cpp puts "\n" before a part once some text exists (vLLM's "\n".join agrees unless a part is empty).
    three = [{"type": "text", "text": t} for t in ("a", "", "b")]
    assert ChatMessage.model_validate({"role": "user", "content": three}).text() == "a\n\nb"


def test_text_parts_count_as_the_newline_joined_string(tok):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]
    joined = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is\nthe best book"}]
    as_parts = [joined[0], {"role": "user", "content": parts}]
    ids = [chat(tok, messages=m)[1][0].ids for m in (as_parts, joined)]
    assert ids[0] == ids[1]


# -- logit_bias -----------------------------------------------------------------------------------
def test_every_logit_bias_form_llama_cpp_documents(tok):
    paris = tok.encode(" Paris", add_special=False)
    hello = tok.encode("Hello, World!", add_special=False)
    assert len(hello) > 1  # every token of a text gets the bias
    assert _completion(tok, logit_bias={"15": 2}).logit_bias == {15: 2.0}  # OpenAI's
    assert _completion(tok, logit_bias={" Paris": -3}).logit_bias == dict.fromkeys(paris, -3.0)
    assert _completion(tok, logit_bias=[[15, 2], ["Hello, World!", -0.5]]).logit_bias == {
        15: 2.0,
        **dict.fromkeys(hello, -0.5),
    }
    # In the array form a string is always a text, even one of digits (llama.cpp: `el[0].is_string()`).
    assert _completion(tok, logit_bias=[["15", 1]]).logit_bias == dict.fromkeys(
        tok.encode("15", add_special=False), 1.0
    )
    banned = _completion(tok, logit_bias={"15": False, "Hello, World!": False}).logit_bias
    assert banned == dict.fromkeys([15, *hello], -math.inf)
    assert _completion(tok, logit_bias=[[15, False]]).logit_bias == {15: -math.inf}


def test_a_ban_survives_the_job_row_and_reaches_the_sampler(tok):
    p = _completion(tok, logit_bias={"15": False, "16": 1})
    stored = json.loads(json.dumps(p.to_json(), allow_nan=False))  # what Postgres' jsonb can hold
    assert stored["logit_bias"] == {"15": "-inf", "16": 1.0}
    again = GenerationParams.from_json(stored)
    assert again.logit_bias == {15: -math.inf, 16: 1.0}
    assert sampler_plan(again, 1, tok.n_vocab, 1024)[0] == ("logit_bias", (((15, -math.inf), (16, 1.0)),))


def test_chat_takes_the_same_forms(tok):
    params = chat(tok, logit_bias={" Paris": False})[0]
    assert params.logit_bias == dict.fromkeys(tok.encode(" Paris", add_special=False), -math.inf)


@pytest.mark.parametrize(
    "bias",
    [
        {"99999999": 1},  # an id outside the vocabulary
        {"-1": 1},
        {"": 1},  # an empty text names no token
        [[1, True]],  # llama.cpp skips `true`; Spool never silently ignores
        [["x", 101]],
        [[1.5, 1]],
        [["x" * (LOGIT_BIAS_TEXT_BYTES + 1), 1]],  # the texts are bounded
    ],
)
def test_logit_bias_refusals_name_it(tok, bias):
    with pytest.raises(DomainError) as err:
        _completion(tok, logit_bias=bias)
    assert err.value.param == "logit_bias"


def test_logit_bias_entries_are_bounded_by_the_vocabulary(tok):
    with pytest.raises(DomainError) as err:
        _completion(tok, logit_bias=[[1, 1]] * (tok.n_vocab + 1))
    assert err.value.param == "logit_bias" and str(tok.n_vocab) in err.value.message


# -- a forced tool call cut inside an argument holding "</tool_call>" --------------------------------
CUT_INSIDE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris </tool_call> and then mo'


def test_a_cut_forced_call_keeps_its_arguments_past_a_closing_tag_in_a_string():
    content, calls = chat_template.parse_tool_calls(CUT_INSIDE, ["get_weather"])
    assert content == ""
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris </tool_call> and then mo'}]
    # A whole call before it, and a second one cut the same way.
    two = (
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {"q": "</tool_call>'
    )
    assert chat_template.parse_tool_calls(two, ["f"])[1] == [
        {"name": "f", "arguments": "{}"},
        {"name": "f", "arguments": '{"q": "</tool_call>'},
    ]


# -- tool-call grammars admit only declared keys ----------------------------------------------------
@pytest.fixture(scope="module")
def ll(tok):
    from llguidance.llamacpp import lltokenizer_from_vocab

    return lltokenizer_from_vocab(tok.vocab)


def _accepts(tok, ll, lark: str, text: str) -> bool:
    m = LLMatcher(ll, LLMatcher.grammar_from_lark(lark), log_level=0)
    ids = tok.encode(text, add_special=False)
    return m.validate_tokens(ids) == len(ids)


def _call(args: dict) -> str:
    return '<tool_call>\n{"name": "f", "arguments": ' + json.dumps(args) + "}\n</tool_call>"


def test_a_forced_call_admits_only_the_keys_its_schema_declares(tok, ll):
    one = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    lark = constraints.tool_calls([("f", one)], parallel=False)
    assert _accepts(tok, ll, lark, _call({"city": "Paris"}))
    assert not _accepts(tok, ll, lark, _call({"city": "Paris", "country": "France"}))
    nested = {"type": "object", "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    lark = constraints.tool_calls([("f", nested)], parallel=False)
    assert not _accepts(tok, ll, lark, _call({"where": {"city": "Paris", "zip": "75"}}))
    # Said otherwise, explicitly: extra keys are the schema's own choice.
    open_ = {**one, "additionalProperties": True}
    assert _accepts(tok, ll, constraints.tool_calls([("f", open_)], parallel=False), _call({"city": "P", "x": 1}))
    typed = {**one, "additionalProperties": {"type": "integer"}}
    lark = constraints.tool_calls([("f", typed)], parallel=False)
    assert _accepts(tok, ll, lark, _call({"city": "P", "x": 1}))
    assert not _accepts(tok, ll, lark, _call({"city": "P", "x": "y"}))


def test_closing_leaves_the_clients_schema_and_allof_parts_alone():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "allOf": [{"properties": {"b": {}}}]}
    closed = constraints.closed_schema(schema)
    assert closed["additionalProperties"] is False and "additionalProperties" not in closed["allOf"][0]
    assert "additionalProperties" not in schema  # a copy


def test_a_function_without_parameters_takes_none(tok, ll):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    grammar = chat(tok, tools=tools, tool_choice="required")[0].grammar
    for args, ok in (({}, True), ({"x": 1}, False)):
        m = LLMatcher(ll, grammar, log_level=0)
        ids = tok.encode(_call(args), add_special=False)
        assert (m.validate_tokens(ids) == len(ids)) is ok


# -- strict ---------------------------------------------------------------------------------------
STRICT_OK = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": ["string", "null"], "enum": ["c", "f", None]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def _strict_tool(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": parameters}}]


@pytest.mark.parametrize(
    ("parameters", "why"),
    [
        ({**STRICT_OK, "additionalProperties": True}, "additionalProperties"),
        ({k: v for k, v in STRICT_OK.items() if k != "additionalProperties"}, "additionalProperties"),
        ({**STRICT_OK, "required": ["city"]}, "missing 'unit'"),
        ({"anyOf": [STRICT_OK]}, "root"),
        ({**STRICT_OK, "properties": {"w": {"type": "object", "properties": {"c": {}}}}, "required": ["w"]}, "at"),
        ({**STRICT_OK, "allOf": [{}]}, "allOf"),
    ],
)
def test_strict_functions_must_have_a_strict_schema(tok, parameters, why):
    for choice in ("auto", "required"):
        with pytest.raises(DomainError) as err:
            chat(tok, tools=_strict_tool(parameters), tool_choice=choice)
        assert err.value.param == "tools" and why in err.value.message, err.value.message


def test_a_valid_strict_schema_is_accepted(tok):
    defs = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/place"}},
        "required": ["where"],
        "additionalProperties": False,
        "$defs": {
            "place": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            }
        },
    }
    for parameters in (STRICT_OK, defs):
        assert chat(tok, tools=_strict_tool(parameters), tool_choice="required")[0].grammar
    # Not strict: a loose schema is still accepted (and closed for the grammar).
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert chat(tok, tools=loose, tool_choice="required")[0].grammar


# -- docs ------------------------------------------------------------------------------------------
def test_parameters_doc_states_reproducibility_and_the_deliberate_differences():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "parameters.md").read_text()
    assert "## Reproducibility" in doc and "## Where Spool differs from the seeds on purpose" in doc
    table = doc.split("## Where Spool differs from the seeds on purpose", 1)[1].split("\n## ", 1)[0]
    assert "| parameter | what the seed does | what Spool does | why |" in table
    for name in ("`logit_bias`", "`seed`", "`strict: true`"):
        assert name in table
    repro = doc.split("## Reproducibility", 1)[1].split("\n## ", 1)[0]
    assert "`cache_prompt: false`" in repro and "bit for bit" in repro
    # The row the issue found wrong: no longer promising the same text whatever the cache holds.
    assert "across repeats, batch neighbours and worker restarts |" not in doc
