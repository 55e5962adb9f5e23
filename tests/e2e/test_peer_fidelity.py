"""Issue 38, against the real processes and SmolLM2: chat text parts joined by a newline (llama.cpp and
vLLM), every `logit_bias` form llama.cpp's server documents, a forced tool call cut inside an argument
that holds "</tool_call>" (streamed and not), tool-call grammars that admit only declared keys,
OpenAI's `strict`, and what `cache_prompt: false` guarantees about reproducibility."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from core.generation import chat_template
from core.infra.tokenizers import tokenizer_for
from tests import openapi
from tests.conftest import MODEL
from tests.sse import collect

CAPITAL = "The capital of France is"
PARTS = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]


def _post(stack, path: str, **body) -> dict:
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- chat text parts ------------------------------------------------------------------------------
def test_text_parts_reach_the_model_joined_by_a_newline(stack):
    """llama.cpp's server test sends these parts and counts the newline-joined prompt; Spool glued them
    ("What isthe best book") and counted one token fewer."""
    tok = tokenizer_for(MODEL)

    def count(content: str) -> int:
        text = chat_template.render(
            tok.chat_template(),
            [{"role": "system", "content": "Book"}, {"role": "user", "content": content}],
            add_generation_prompt=True,
        )
        return len(tok.encode(text, add_special=False))

    joined, glued = count("What is\nthe best book"), count("What isthe best book")
    assert joined != glued
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": PARTS}]
    raw = _post(stack, "/v1/chat/completions", messages=messages, max_tokens=1, temperature=0)
    assert raw["usage"]["prompt_tokens"] == joined
    r = stack.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == joined
    # The same prompt as the string joined by hand: the same greedy answer.
    as_text = [messages[0], {"role": "user", "content": "What is\nthe best book"}]
    same = _post(stack, "/v1/chat/completions", messages=as_text, max_tokens=8, temperature=0)
    parts = _post(stack, "/v1/chat/completions", messages=messages, max_tokens=8, temperature=0)
    assert parts["choices"][0]["message"]["content"] == same["choices"][0]["message"]["content"]


# -- logit_bias -----------------------------------------------------------------------------------
def _first(stack, **body) -> tuple[str, str]:
    """(the first generated token's text, the whole text) of a greedy completion of CAPITAL."""
    data = _post(stack, "/v1/completions", prompt=CAPITAL, max_tokens=3, temperature=0, logprobs=0, **body)
    choice = data["choices"][0]
    return choice["logprobs"]["tokens"][0], choice["text"]


def test_every_logit_bias_form_bans_the_greedy_token(stack):
    piece, whole = _first(stack)
    tid = _post(stack, "/tokenize", content=piece, add_special=False)["tokens"]
    assert len(tid) == 1, (piece, tid)  # the greedy token's own text names that token alone
    (first,) = tid
    forms = {
        "openai id": {str(first): -100},
        "id: false": {str(first): False},
        "[[id, bias]]": [[first, -100]],
        "[[id, false]]": [[first, False]],
        "text: false": {piece: False},
        "[[text, false]]": [[piece, False]],
        "text: -100": {piece: -100},
    }
    for name, bias in forms.items():
        got, text = _first(stack, logit_bias=bias)
        assert got != piece and text != whole, (name, got, text)
    # And a positive bias by text forces it, as an id does.
    forced = _post(stack, "/tokenize", content=" banana", add_special=False)["tokens"]
    if len(forced) == 1:
        _, text = _first(stack, logit_bias=[[" banana", 100]])
        assert text == " banana" * 3


def test_chat_takes_the_same_logit_bias_forms(stack):
    client = stack.openai()
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "max_tokens": 6,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**body).choices[0].message.content or ""
    assert "Paris" in plain
    for bias in ({"Paris": False, " Paris": False}, [["Paris", False], [" Paris", False]]):
        banned = client.chat.completions.create(**body, extra_body={"logit_bias": bias}).choices[0].message.content
        assert "Paris" not in (banned or ""), (bias, banned)


def test_a_bad_logit_bias_is_a_400_naming_it(stack):
    with stack.http(stack.keys["alpha"]) as http:
        for bias in ([[1, True]], {"": 1}, [[10**9, 1]], [[1]]):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": bias})
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias"), (bias, r.text)


# -- a forced tool call cut inside an argument that holds "</tool_call>" ----------------------------
TAGGED = "Paris </tool_call> and some more words after the tag, then the end of this city name"
ECHO = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "const": TAGGED}},
            "required": ["city"],
        },
    },
}


def test_a_forced_call_cut_after_a_closing_tag_inside_its_arguments_keeps_them(stack):
    client = stack.openai()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Look up the city."}],
        "tools": [ECHO],
        "tool_choice": "required",
        "temperature": 0,
    }
    whole = client.chat.completions.create(**body, max_tokens=120, logprobs=True)
    call = whole.choices[0].message.tool_calls[0].function
    assert json.loads(call.arguments) == {"city": TAGGED}
    # Where the tag inside the argument is complete: cut a few tokens after it.
    pieces = [t.token for t in whole.choices[0].logprobs.content]
    ends = [len("".join(pieces[: i + 1])) for i in range(len(pieces))]
    tag_end = "".join(pieces).index("</tool_call> and") + len("</tool_call> and")
    cut_at = next(i for i, e in enumerate(ends) if e >= tag_end) + 2  # tokens: a few past the tag
    assert cut_at < len(pieces) - 5
    r = client.chat.completions.create(**body, max_tokens=cut_at)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    [cut] = c.message.tool_calls
    assert cut.function.name == "lookup"
    assert cut.function.arguments.startswith('{"city": "Paris </tool_call> and'), cut.function.arguments
    assert call.arguments.startswith(cut.function.arguments) and len(cut.function.arguments) < len(call.arguments)
    openapi.validate(r.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    # Streamed: the same call, as tool_calls deltas, never as content.
    with stack.http(stack.keys["alpha"]) as http:
        with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": cut_at, "stream": True}) as s:
            assert s.status_code == 200
            events, done = collect(s)
    assert done
    chunks = [e.json for e in events]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch.get("choices")]
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [(tc["function"]["name"], tc["function"]["arguments"]) for tc in calls] == [
        ("lookup", cut.function.arguments)
    ]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch.get("choices")][-1] == "length"


# -- tool-call grammars and strict ----------------------------------------------------------------
ONE_FIELD = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}},
    },
}


def _forced_call(client: openai.OpenAI, content: str, tool: dict, max_tokens: int):
    """The choice of a greedy chat completion of one user message that must call `tool`."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_tokens=max_tokens,
    )
    return r.choices[0]


def test_a_forced_call_has_only_the_declared_keys(stack):
    c = _forced_call(stack.openai(), "What's the weather like in Paris, in celsius, today and tomorrow?", ONE_FIELD, 80)
    assert c.finish_reason == "tool_calls", c
    assert set(json.loads(c.message.tool_calls[0].function.arguments)) <= {"city"}


def test_strict_functions_need_a_strict_schema(stack):
    client = stack.openai()
    loose = {**ONE_FIELD["function"], "strict": True}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": loose}]
        )
    assert err.value.body["param"] == "tools" and "additionalProperties" in err.value.body["message"]
    params = {**loose["parameters"], "required": ["city"], "additionalProperties": False}
    ok = {"type": "function", "function": {**loose, "parameters": params}}
    c = _forced_call(client, "Weather in Paris?", ok, 60)
    assert set(json.loads(c.message.tool_calls[0].function.arguments)) == {"city"}


# -- reproducibility ------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95}])
def test_cache_prompt_false_replays_bit_for_bit_whatever_the_cache_holds(stack, sampling):
    """docs/parameters.md: with `cache_prompt: false` a seeded request is decoded from its first token
    every time, so the same request gives the same text, whatever other requests left in the cache."""
    prompt = "Once upon a time, in a small village by the sea, there lived"
    body = {"prompt": prompt, "max_tokens": 40, "seed": 4242, "cache_prompt": False, "logprobs": 1, **sampling}
    first = _post(stack, "/v1/completions", **body)["choices"][0]
    # Warm the cache with this prompt and a longer one sharing its prefix (cache_prompt on).
    _post(stack, "/v1/completions", prompt=prompt, max_tokens=30, temperature=0)
    _post(stack, "/v1/completions", prompt=prompt + " an old fisherman", max_tokens=12, temperature=0.7, seed=1)
    again = _post(stack, "/v1/completions", **body)["choices"][0]
    assert again["text"] == first["text"]
    assert again["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"]  # bit for bit
    # And with other sequences decoding beside it in the same batches.
    others = [{"prompt": prompt + " a", "max_tokens": 40, "temperature": 0.8, "seed": i} for i in range(3)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, stack, "/v1/completions", **b) for b in (*others, body)]
        beside = futures[-1].result()["choices"][0]
        [f.result() for f in futures[:-1]]
    assert beside["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"]
    usage = _post(stack, "/v1/completions", **{**body, "max_tokens": 1})["usage"]
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
