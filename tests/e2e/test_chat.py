"""Chat completions on the durable job path, with the official `openai` client against the real
SmolLM2: answers, streaming, logprobs, JSON schemas, tool calls, jobs and batches in the chat shape,
every response and chunk validated against OpenAI's published schema."""

from __future__ import annotations

import io
import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from core.generation import chat_template
from core.infra.tokenizers import tokenizer_for
from tests import openapi
from tests.conftest import MODEL, job_row, wait_for
from tests.helpers import PERSON, WEATHER
from tests.sse import collect, events


def _asked(question: str) -> list[dict]:
    """The OpenAI quick start's conversation: a system prompt, then the question."""
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]


def _chat(stack, tenant: str = "alpha", **body) -> httpx.Response:
    with stack.http(stack.keys[tenant]) as http:
        return http.post("/v1/chat/completions", json={"model": MODEL, **body})


def test_the_openai_client_gets_a_sensible_answer(stack):
    client = stack.openai()
    r = client.chat.completions.create(
        model=MODEL,
        # The OpenAI quick start's shape. (Without a system message SmolLM2's template adds its own,
        # and this 135M model then rambles in French: checked with llama-cpp-python's own chat too.)
        messages=_asked("What is the capital of France?"),
        temperature=0,
        max_tokens=40,
    )
    assert r.object == "chat.completion"
    assert "paris" in (r.choices[0].message.content or "").lower()
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.system_fingerprint.startswith("fp_")
    openapi.validate(r.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")


def test_prompt_is_the_models_own_template_and_usage_counts_it(stack):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
    ]
    r = _chat(stack, messages=messages, max_tokens=5, temperature=0)
    assert r.status_code == 200, r.text
    tok = tokenizer_for(MODEL)
    text = chat_template.render(
        tok.chat_template(), [messages[0], {"role": "user", "content": "Name a color."}], add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nYou are terse.<|im_end|>" in text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special=False))


def test_streaming_deltas_concatenate_to_the_non_streaming_text(stack):
    client = stack.openai()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about cats."}],
        "temperature": 0.8,
        "seed": 11,
        "max_tokens": 30,
    }
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for c in chunks:
        assert c.object == "chat.completion.chunk" and c.id == chunks[0].id
        openapi.validate(
            c.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionStreamResponse", chunk=True
        )


def test_logprobs_in_the_chat_shape(stack):
    r = _chat(
        stack,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        ignore_eos=True,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    openapi.validate(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and body["usage"]["completion_tokens"] == 6
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    for e in content:
        assert e["logprob"] <= 0 and bytes(e["bytes"]).decode(errors="replace") == e["token"]
        assert len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6  # greedy: the top one was taken


def test_json_schema_strict_answers_valid_json_on_the_wire(stack):
    """One sample on the wire; 50 of 50 are valid in tests/integration/test_constrained_samples.py."""
    client = stack.openai()
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}},
        seed=3,
        temperature=1.0,
        max_tokens=120,
    )
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)
    openapi.validate(r.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")


def _weather_call(client, question: str, tool_choice, **sampling):
    """One user question with the weather tool offered and a tool call asked for (`tool_choice`)."""
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        tools=[WEATHER],
        tool_choice=tool_choice,
        max_tokens=80,
        **sampling,
    )


def test_a_named_tool_choice_yields_a_valid_call_on_the_wire(stack):
    """One sample on the wire; 50 of 50 are valid in tests/integration/test_constrained_samples.py."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _weather_call(stack.openai(), "What's the weather like in Paris?", named, seed=5, temperature=1.0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    openapi.validate(r.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")


def test_tool_calls_stream_as_tool_call_deltas(stack):
    client = stack.openai()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "seed": 9,
        "temperature": 0.7,
        "max_tokens": 80,
    }
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
        (tc.function.name, tc.function.arguments) for tc in whole.choices[0].message.tool_calls
    ]
    assert all(tc.id.startswith("call_") and tc.type == "function" for tc in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for c in chunks:
        openapi.validate(
            c.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionStreamResponse", chunk=True
        )


def test_a_tool_round_trip_renders_through_the_template(stack):
    client = stack.openai()
    first = _weather_call(client, "What's the weather in Rome?", "required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "What's the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=30
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # What the model saw: the call written back in its format, the result as a tool response.
    tok = tokenizer_for(MODEL)
    rendered = chat_template.render(
        tok.chat_template(),
        [
            {
                "role": m["role"],
                "content": m.get("content") or "",
                **({"tool_calls": m["tool_calls"]} if "tool_calls" in m else {}),
            }
            for m in messages
        ],
        tools=[WEATHER],
    )
    assert '<tool_response>\n{"temperature": 21' in rendered and '"name": "get_weather"' in rendered
    assert answer.usage.prompt_tokens == len(tok.encode(rendered, add_special=False))


def test_the_sdks_own_helpers_parse_and_stream(stack):
    """The `openai` SDK's structured-output and streaming helpers, unchanged, against Spool."""

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)

    client = stack.openai()
    parsed = client.chat.completions.parse(
        model=MODEL,
        messages=_asked("Give me a city as JSON."),
        response_format=City,
        temperature=0,
        max_tokens=100,
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    with client.chat.completions.stream(
        model=MODEL,
        messages=_asked("What is the capital of France?"),
        temperature=0,
        max_tokens=60,
    ) as stream:
        final = stream.get_final_completion()
    assert "Paris" in (final.choices[0].message.content or "") and final.choices[0].finish_reason == "stop"


def test_a_chat_job_is_queued_polled_and_replayed_in_the_chat_shape(stack, db):
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8, "temperature": 0},
            headers={"Prefer": "respond-async"},
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        job = wait_for(lambda: (j := http.get(f"/v1/jobs/{job_id}").json())["status"] == "succeeded" and j, 120, "job")
        assert job["result"]["object"] == "chat.completion"
        openapi.validate(job["result"], "CreateChatCompletionResponse")
        with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            evs, done = collect(resp)
        assert done and evs[0].json["object"] == "chat.completion.chunk"
        assert (
            "".join(e.json["choices"][0]["delta"].get("content") or "" for e in evs if e.json["choices"])
            == (job["result"]["choices"][0]["message"]["content"])
        )
    assert job_row(db, job_id)["chat"] is not None


def test_a_batch_of_chat_lines_returns_every_custom_id_once(stack):
    client = stack.openai()
    lines = [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Count to {i}."}],
                "max_tokens": 6,
                "temperature": 0,
            },
        }
        for i in range(12)
    ]
    f = client.files.create(
        file=("chat.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch"
    )
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_for(lambda: (x := client.batches.retrieve(b.id)).status in ("completed", "failed") and x, 300, "batch")
    assert b.status == "completed", b.errors
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"chat-{i}" for i in range(12))
    for o in out:
        assert o["response"]["status_code"] == 200
        openapi.validate(o["response"]["body"], "CreateChatCompletionResponse")


def test_a_batch_mixing_endpoints_is_refused_naming_the_line(stack):
    client = stack.openai()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "Hi"}},
    ]
    f = client.files.create(file=("mix.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_for(lambda: (x := client.batches.retrieve(b.id)).status in ("failed", "completed") and x, 120, "batch")
    assert b.status == "failed"
    assert [(e.line, e.code) for e in b.errors.data] == [(2, "mismatched_url")]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_chat_requests_are_400s_naming_the_parameter(stack, body, param):
    r = _chat(stack, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    openapi.validate(r.json(), "ErrorResponse")
    assert (err["param"] or "").startswith(param), err


def test_llama_stacks_paths_serve_chat_and_models(stack):
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post(
            "/v1/openai/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        assert MODEL in [m["id"] for m in http.get("/v1/openai/v1/models").json()["data"]]


# -- what vLLM's own server tests expect of a chat endpoint (issue 24) -------------------------------

STORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a long story about a dragon who learns to bake bread."},
]


# A question the model answers in ~60 tokens and then ends its turn by itself, greedily: past
# completions' 16, and cheap. It was an ~870-token story run on to the context's end (2 x 1,024 tokens
# through the engine, whose prefill costs about what generating does: 25 s of the suite); the
# context's end is shown by `max_tokens: -1` (test_protocol) and the reservation test below.
ENDS_BY_ITSELF = [{"role": "user", "content": "Say hello in French and in Spanish."}]


FRESH = {"cache_prompt": False}


def test_a_chat_without_max_tokens_runs_past_16_to_the_models_own_stop(stack):
    """No max_tokens: up to the model's stop or the context's end (OpenAI, vLLM), not completions' 16."""
    client = stack.openai()

    def streamed_run() -> list:
        return list(
            client.chat.completions.create(
                model=MODEL,
                messages=ENDS_BY_ITSELF,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=FRESH,
            )
        )

    # One after the other, each prefilling its own prompt (`cache_prompt: false`): prompts prefilled
    # side by side are cut into different chunks, and a cached prefix is not the same KV either, so
    # either may part from the other after a few dozen greedy tokens (docs/parameters.md).
    r = client.chat.completions.create(model=MODEL, messages=ENDS_BY_ITSELF, temperature=0, extra_body=FRESH)
    chunks = streamed_run()
    c = r.choices[0]
    assert c.finish_reason == "stop" and r.usage.completion_tokens > 16, (c.finish_reason, r.usage)
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == c.message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_chat_without_max_tokens_reserves_the_rest_of_the_context(stack):
    """Costs stay bounded: admission takes prompt + (context - prompt) from the token limits, not 16."""
    key = stack.new_tenant("unbounded-chat", tpm=100_000)
    body = {"model": MODEL, "messages": STORY, "temperature": 0, "stream": True}
    with stack.http(key) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        # what admission took is in the headers, before any token: no need to wait for ~1,000 of them
        assert r.status_code == 200, r.read()
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 100_000 - 1024  # the test stack's context


def test_continue_final_message_and_response_format_answers_are_not_cut_at_16(stack):
    schema = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 120, "maxLength": 300}},
        "required": ["story"],
        "additionalProperties": False,
    }
    r = _chat(
        stack,
        messages=STORY,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "story", "strict": True, "schema": schema}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] > 16, body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    body = {
        "model": MODEL,
        "messages": [*STORY, {"role": "assistant", "content": "Once upon a time, in a village by the mountains,"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "temperature": 0,
        "stream": True,
    }
    pieces = 0  # content chunks, each at least one token: past 16, it was not cut at completions' default
    with stack.http(stack.keys["alpha"]) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for ev in events(r):
            if ev.data == "[DONE]" or pieces > 16:
                break  # it runs on to the context's end (~1,000 tokens): 17 are enough to know
            pieces += sum(1 for c in json.loads(ev.data)["choices"] if c["delta"].get("content"))
    assert pieces > 16


def test_chat_top_logprobs_20_returns_20_alternatives(stack):
    client = stack.openai()
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
        "extra_body": {"ignore_eos": True},
    }
    r = client.chat.completions.create(**ask)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        alts = e.top_logprobs
        assert len(alts) == 20 and len({a.token for a in alts}) == 20
        assert [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [len(e.top_logprobs) for e in streamed] == [20] * 4


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 20}, "logprobs"),
    ],
)
def test_logprob_ranges_out_of_bounds_are_400s_naming_them(stack, path, body, param):
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param), r.json()


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_tool_call_cut_by_max_tokens_is_a_tool_call(stack, choice):
    client = stack.openai()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What's the weather like in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": choice,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**body, max_tokens=80).choices[0].message.tool_calls[0].function
    for max_tokens in (12, 22):
        r = client.chat.completions.create(**body, max_tokens=max_tokens)
        c = r.choices[0]
        assert c.finish_reason == "length" and r.usage.completion_tokens == max_tokens
        assert c.message.content is None and "<tool_call>" not in (c.message.content or "")
        [call] = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert whole.arguments.startswith(call.function.arguments) and len(call.function.arguments) < len(
            whole.arguments
        )
        openapi.validate(r.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
        chunks = list(client.chat.completions.create(**body, max_tokens=max_tokens, stream=True))
        assert not "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
        calls = [tc for x in chunks if x.choices for tc in (x.choices[0].delta.tool_calls or [])]
        assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("get_weather", call.function.arguments)]
        assert [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason] == ["length"]


def test_a_prediction_speeds_nothing_but_the_steps_and_usage_counts_it(stack):
    """OpenAI's Predicted Outputs: the answer is the one without a prediction (greedy, and with a
    stop string cutting a step that brought several tokens); usage counts the prediction's accepted
    and rejected tokens (docs/performance.md)."""
    from ops.bench.speculative import REWRITE

    ask, predicted = REWRITE[0]
    client = stack.openai()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": ask}], "temperature": 0, "max_tokens": 60}
    for extra in ({}, {"stop": ["Visitors"]}):
        plain = client.chat.completions.create(**kw, **extra, extra_body={"speculative": "off", "cache_prompt": False})
        fast = client.chat.completions.create(
            **kw, **extra, prediction={"type": "content", "content": predicted}, extra_body={"cache_prompt": False}
        )
        assert fast.choices[0].message.content == plain.choices[0].message.content
        assert fast.choices[0].finish_reason == plain.choices[0].finish_reason
        assert fast.usage.completion_tokens == plain.usage.completion_tokens
        details = fast.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
        assert details.accepted_prediction_tokens < fast.usage.completion_tokens
        assert plain.usage.completion_tokens_details is None
