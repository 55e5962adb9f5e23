"""Neutral events -> OpenAI stream chunks and completion objects, validated against the reference
schema (pure: no database, no Redis)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from core.config import Settings
from core.generation import chat_template
from core.generation.events import ChoiceResult, Delta, Done, Failed, JobResult, TokenScore, TopToken, Usage
from core.generation.params import GenerationParams
from core.protocol import render
from tests import openapi

FP = "fp_0123456789"  # a model's system_fingerprint, as the caller passes it (render.Fingerprints)


def _job(**params):
    return SimpleNamespace(
        id="cmpl-x",
        model="m",
        state="succeeded",
        attempt=1,
        params=GenerationParams(**params).to_json(),
        chat=None,
        result=None,
        usage=None,
        error=None,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        started_at=None,
        finished_at=None,
    )


def test_delta_chunk_matches_schema():
    out = render.CompletionChunks(_job(), include_usage=True, fingerprint=FP).render(Delta(choice=0, text="Hi"))
    body = out[0]
    assert body["choices"][0] == {"text": "Hi", "index": 0, "logprobs": None, "finish_reason": None}
    assert body["usage"] is None  # include_usage: null on every chunk but the last, as OpenAI does
    assert body["system_fingerprint"] == FP
    without = render.CompletionChunks(_job(), include_usage=False, fingerprint=FP)
    assert "usage" not in without.render(Delta(choice=0, text="Hi"))[0]
    openapi.validate(body, "CreateCompletionResponse", chunk=True)


def test_a_fingerprint_names_what_serves_the_model():
    """Worked out from the settings the caller holds (rendering reads none), once per model."""
    m = "smollm2-135m-instruct"
    fp = render.system_fingerprint(m, Settings())
    assert fp.startswith("fp_") and len(fp) == 13 and fp == render.system_fingerprint(m, Settings())
    assert render.system_fingerprint(m, Settings(n_ctx=1024)) != fp  # another setup, another fingerprint
    assert render.system_fingerprint("gone", Settings()).startswith("fp_")  # a model no longer served
    fps = render.Fingerprints(Settings())
    assert fps(m) == fp and fps(m) is fps(m)


def test_empty_delta_without_finish_is_not_sent():
    assert render.CompletionChunks(_job(), False, FP).render(Delta(choice=0, text="")) == []


def test_done_sends_usage_then_done_marker():
    u = Usage(prompt_tokens=1, completion_tokens=2)
    out = render.CompletionChunks(_job(), include_usage=True, fingerprint=FP).render(Done(usage=u))
    assert out[0]["choices"] == [] and out[0]["usage"]["total_tokens"] == 3
    openapi.validate(out[0], "CreateCompletionResponse", chunk=True)
    assert out[1] == render.DONE
    assert render.CompletionChunks(_job(), False, FP).render(Done(usage=u)) == [render.DONE]


def test_failed_event_is_an_error_object_then_done():
    out = render.CompletionChunks(_job(), False, FP).render(Failed(error={"message": "no", "code": "x"}))
    assert out == [{"error": {"message": "no", "type": "server_error", "param": None, "code": "x"}}, render.DONE]


def _scores():
    prompt = [
        TokenScore(id=1, text="A", logprob=None, offset=0),
        TokenScore(id=2, text="B", logprob=-0.5, rank=3, offset=1, top=[TopToken(id=9, text="Z", logprob=-0.1)]),
    ]
    gen = [TokenScore(id=3, text="C", logprob=-1.0, offset=2, top=[TopToken(id=4, text="D", logprob=-0.2)])]
    return prompt, gen


def test_echo_logprobs_join_prompt_and_generated_tokens_in_openai_shape():
    prompt, gen = _scores()
    job = _job(echo=True, logprobs=1, prompt_logprobs=1)
    job.result = JobResult(
        choices=[
            ChoiceResult(index=0, text="ABC", finish_reason="length", prefix_len=2, scores=gen, prompt_scores=prompt)
        ]
    ).model_dump()
    job.usage = Usage(prompt_tokens=2, completion_tokens=1).model_dump()
    body = render.completion(job, FP)
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["A", "B", "C"] and lp["token_logprobs"] == [None, -0.5, -1.0]
    assert lp["top_logprobs"] == [None, {"Z": -0.1, "B": -0.5}, {"D": -0.2, "C": -1.0}]
    assert lp["text_offset"] == [0, 1, 2]
    # vLLM's prompt_logprobs: ranked alternatives, the token itself with its own rank
    assert body["choices"][0]["prompt_logprobs"] == [
        None,
        {
            "9": {"logprob": -0.1, "rank": 1, "decoded_token": "Z"},
            "2": {"logprob": -0.5, "rank": 3, "decoded_token": "B"},
        },
    ]
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 1,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    openapi.validate(body, "CreateCompletionResponse", echo=True)


def test_job_object_renders_a_failed_job_error():
    job = _job()
    job.state, job.error = "failed", {"message": "boom", "type": "server_error", "code": "engine_error"}
    body = render.job(job, FP)
    assert body["result"] is None and body["error"]["code"] == "engine_error"


def test_events_survive_the_stream_encoding_with_null_logprobs():
    """The first prompt token has no logprob: encoded without nulls, it must still decode."""
    from core.generation.events import decode, encode

    prompt, gen = _scores()
    ev = Delta(choice=0, text="AB", prefix_len=2, prompt_scores=prompt, scores=gen)
    assert decode(encode(ev)) == ev


# -- a forced tool call that max_tokens cut is still a tool call ------------------------------------

CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'


def _chat_job(text: str, finish: str, forced: list[str] | None):
    job = _job()
    job.chat = {"tools": True, "top_logprobs": None, **({"forced": forced} if forced else {})}
    job.result = JobResult(choices=[ChoiceResult(index=0, text=text, finish_reason=finish)]).model_dump()
    job.usage = Usage(prompt_tokens=5, completion_tokens=12).model_dump()
    return job


def test_a_cut_forced_tool_call_is_a_tool_call_with_finish_length():
    body = render.chat_completion(_chat_job(CUT, "length", ["get_weather"]), FP)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert call["id"].startswith("call_") and call["type"] == "function"
    openapi.validate(body, "CreateChatCompletionResponse")
    # Offered but not forced (tool_choice auto): words the model chose stay words.
    auto = render.chat_completion(_chat_job(CUT, "length", None), FP)["choices"][0]
    assert auto["message"]["content"] == CUT and "tool_calls" not in auto["message"]


def test_a_cut_forced_tool_call_streams_as_tool_call_deltas():
    chunks = render.ChatChunks(_chat_job("", "length", ["get_weather"]), include_usage=False, fingerprint=FP)
    pieces = [CUT[:5], CUT[5:20], CUT[20:]]
    out = [
        c
        for i, p in enumerate(pieces)
        for c in chunks.render(Delta(choice=0, text=p, finish_reason="length" if i == 2 else None))
    ]
    deltas = [c["choices"][0]["delta"] for c in out if isinstance(c, dict)]
    assert not any(d.get("content") for d in deltas)  # no markup leaks as content
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(tc["function"]["name"], tc["function"]["arguments"]) for tc in calls] == [("get_weather", '{"city": "Par')]
    assert out[-1]["choices"][0]["finish_reason"] == "length"
    for c in out:
        openapi.validate(c, "CreateChatCompletionStreamResponse", chunk=True)


@pytest.mark.parametrize(
    ("text", "forced", "calls"),
    [
        ("<tool_", ["get_weather"], [("get_weather", "")]),  # cut inside the opening tag
        ('<tool_call>\n{"name": "get_w', ["get_weather", "get_time"], [("get_weather", "")]),  # a prefix names one
        ('<tool_call>\n{"name": "get_', ["get_weather", "get_time"], [("get_", "")]),  # ambiguous: as generated
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', ["f"], [("f", '{"a": 1}')]),  # in the close
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}', ["f"], [("f", '{"a": 1}')]),  # after the arguments
        (
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"b',
            ["f", "g"],
            [("f", "{}"), ("g", '{"b')],
        ),
        ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool', ["f", "g"], [("f", "{}")]),
    ],
)
def test_forced_calls_are_read_up_to_the_cut(text, forced, calls):
    content, got = chat_template.parse_tool_calls(text, forced)
    assert content == "" and [(c["name"], c["arguments"]) for c in got] == calls
