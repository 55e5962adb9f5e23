"""Chat: templates rendered as transformers does, tool calls written and parsed, and the chat
translation sharing the completions one (pure; the tokenizer is the real SmolLM2 vocabulary)."""

from __future__ import annotations

import json

import pytest

from core.config import Settings
from core.errors import DomainError
from core.generation import chat_template
from core.infra.tokenizers import tokenizer_for
from core.protocol.schemas import ChatCompletionRequest
from core.protocol.translate import chat_to_generation

MODEL = "smollm2-135m-instruct"
SETTINGS = Settings(n_ctx=1024)
TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(MODEL)


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw})


def test_the_gguf_template_renders_chatml(tok):
    text = chat_template.render(tok.chat_template(), [{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode("<|im_start|>", add_special=False) == [1]  # a special token, parsed as one


def test_the_sandbox_refuses_unsafe_templates_and_raise_exception_is_a_clean_error():
    with pytest.raises(chat_template.ChatTemplateError):
        chat_template.render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])
    with pytest.raises(chat_template.ChatTemplateError, match="roles must alternate"):
        chat_template.render("{{ raise_exception('roles must alternate') }}", [])
    with pytest.raises(chat_template.ChatTemplateError):
        chat_template.render("{% for %}", [])


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_written_back(tok):
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add 1"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    text = chat_template.render(tok.chat_template(), msgs, tools=[TOOL])
    assert "<|im_start|>system\nBe brief.\n\nYou may call one or more functions" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>" in text


def test_a_template_that_knows_tools_receives_them():
    src = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat_template.render(src, [{"role": "user", "content": "x"}], tools=[TOOL]) == "[add]x"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "", [("add", {"a": 1})]),
        ('Sure.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "Sure.", [("add", {"a": 1})]),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", '
            '"arguments": {"a": 2}}',  # the second cut short of its closing tag
            "",
            [("add", {"a": 1}), ("add", {"a": 2})],
        ),
        ('{"name": "add", "arguments": {"a": 3}}', "", [("add", {"a": 3})]),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        # A sampled argument that itself holds the closing tag (seen in CI: a forced call's "city"):
        # the block ends after the whole object, not at the first "</tool_call>".
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": "][0]}</tool_call> x"}}\n</tool_call>',
            "",
            [("add", {"a": "][0]}</tool_call> x"})],
        ),
        ("Just words.", "Just words.", []),
    ],
)
def test_tool_calls_are_parsed_out_of_the_text(text, content, calls):
    got_content, got = chat_template.parse_tool_calls(text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


def test_a_forced_call_whose_argument_holds_the_closing_tag_keeps_its_arguments():
    """The CI failure of test_a_named_tool_choice_yields_valid_calls_in_50_of_50_samples: one of 50
    samples wrote "</tool_call>" inside its city; the call came out with arguments ''."""
    city = "][0]}</tool_call> The weather-"
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '", "unit": "celsius"}}\n</tool_call>'
    )
    content, calls = chat_template.parse_tool_calls(text, ["get_weather"])
    assert content == "" and len(calls) == 1
    assert json.loads(calls[0]["arguments"]) == {"city": city, "unit": "celsius"}


def test_chat_shares_the_completions_translation(tok):
    params, prompts, meta = chat_to_generation(
        _req(max_completion_tokens=7, temperature=0.5, seed=3, logprobs=True, top_logprobs=2),
        SETTINGS,
        tok,
        tok.chat_template(),
    )
    assert (params.max_tokens, params.temperature, params.logprobs) == (7, 0.5, 2)
    assert prompts[0].ids == tok.encode(
        chat_template.render(tok.chat_template(), [{"role": "user", "content": "hi"}]), add_special=False
    )
    assert meta == {"tools": False, "top_logprobs": 2}


def test_a_forced_tool_call_is_a_grammar_and_auto_only_parses(tok):
    params, _, meta = chat_to_generation(_req(tools=[TOOL], tool_choice="required"), SETTINGS, tok, tok.chat_template())
    assert params.grammar and meta["tools"] is True
    params, _, meta = chat_to_generation(_req(tools=[TOOL]), SETTINGS, tok, tok.chat_template())
    assert params.grammar is None and meta["tools"] is True
    params, _, meta = chat_to_generation(_req(tools=[TOOL], tool_choice="none"), SETTINGS, tok, tok.chat_template())
    assert meta["tools"] is False


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "regex": "a+"}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_completion_tokens": 100_000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 6000}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ],
)
def test_refused_with_the_parameter_named(tok, kw, param):
    with pytest.raises(DomainError) as e:
        chat_to_generation(_req(**kw), SETTINGS, tok, tok.chat_template())
    assert e.value.param == param


def test_a_model_without_a_chat_template_is_a_clear_400(tok):
    with pytest.raises(DomainError) as e:
        chat_to_generation(_req(), SETTINGS, tok, None)
    assert e.value.code == "no_chat_template" and "/v1/completions" in e.value.message
