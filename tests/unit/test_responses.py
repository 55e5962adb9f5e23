"""The Responses API's translation (into the one chat request) and rendering (response objects and
numbered stream events), pure: no services."""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import DomainError
from core.generation.events import Cancelled, Delta, Done, ErrorInfo, Failed, Usage
from core.protocol import render
from core.protocol import responses as wire
from core.protocol.responses import ResponsesRequest
from tests.helpers import T0, response_job

MODEL = "smollm2-135m-instruct"


def _req(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, **body})


def _chat(earlier: list[dict[str, Any]] | None = None, **body: Any):
    return wire.to_chat(_req(**body), earlier or [], MODEL)


def _refused(**body: Any) -> DomainError:
    with pytest.raises(DomainError) as e:
        _chat(**body)
    return e.value


def _job(state: str = "succeeded", text: str = "Hello there.", finish: str = "stop", tools: bool = False, **meta):
    done = state == "succeeded"
    return response_job(
        state,
        {"choices": [{"index": 0, "text": text, "finish_reason": finish}]} if done else None,
        {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}} if done else None,
        error={"message": "boom", "type": "server_error", "code": "engine_error"} if state == "failed" else None,
        tools=tools,
        **meta,
    )


# -- ids -------------------------------------------------------------------------------------------


def test_response_and_job_ids_map_both_ways():
    job_id = "cmpl-0123456789abcdef01234567"
    assert render.response_id(job_id) == "resp_0123456789abcdef01234567"
    assert wire.job_id_of(render.response_id(job_id)) == job_id
    for bad in ("cmpl-0123", "resp_", "resp_XYZ", "resp_" + "a" * 65, "resp_12\x00"):
        assert wire.job_id_of(bad) is None


# -- translation -----------------------------------------------------------------------------------


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    chat = _chat(input="What is 2+2?", instructions="Be terse.", max_output_tokens=7, temperature=0.2, top_p=0.9)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.2 and chat.top_p == 0.9
    assert chat.response["instructions"] == "Be terse." and chat.response["max_output_tokens"] == 7


def test_items_become_chat_messages_tool_calls_and_tool_results():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": '{"c":"P"}'},
        {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": '{"c":"R"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25C"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Warm."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    assert wire.items_to_messages(items) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Weather ?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c":"P"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": '{"c":"R"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25C"},
        {"role": "assistant", "content": "Warm."},
    ]


def test_the_chain_comes_before_the_new_input_and_after_the_instructions():
    earlier = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    chat = _chat(earlier, input="C", instructions="I")
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "I"),
        ("user", "A"),
        ("assistant", "B"),
        ("user", "C"),
    ]


def test_tools_formats_and_choices_map_onto_chats_fields():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    chat = _chat(
        input="x",
        tools=[tool],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
    )
    assert chat.tools is not None and chat.tools[0].function.name == "f" and chat.tools[0].function.strict is True
    assert chat.tool_choice is not None and chat.tool_choice.function == {"name": "f"}  # type: ignore[union-attr]
    assert chat.parallel_tool_calls is False
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
    }
    assert _chat(input="x", text={"format": {"type": "json_object"}}).response_format == {"type": "json_object"}
    assert _chat(input="x", text={"format": {"type": "text"}}).response_format is None


def test_spools_sampling_extensions_pass_through_and_chat_only_fields_do_not():
    chat = _chat(input="x", top_k=5, seed=3, stop=["\n"], min_p=0.1)
    assert (chat.top_k, chat.seed, chat.stop, chat.min_p) == (5, 3, ["\n"], 0.1)
    assert wire.unknown_fields(_req(input="x", messages=[], max_tokens=3, n=2, frob=1)) == [
        "frob",
        "max_tokens",
        "messages",
        "n",
    ]


def test_logprobs_and_truncation():
    chat = _chat(input="x", top_logprobs=3, include=["message.output_text.logprobs"], truncation="auto")
    assert chat.logprobs is True and chat.top_logprobs == 3 and chat.truncate_sequence is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema"),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"input": "x\x00y"}, "input"),
        ({}, "input"),
    ],
)
def test_what_spool_cannot_do_names_the_field(body, param):
    err = _refused(**body)
    assert err.param == param, err.message


def test_errors_of_the_chat_translation_name_the_responses_field():
    assert wire.rename(DomainError("invalid", "x", param="messages")).param == "input"  # type: ignore[arg-type]
    assert wire.rename(DomainError("invalid", "x", param="max_tokens")).param == "max_output_tokens"  # type: ignore[arg-type]
    assert wire.rename(DomainError("invalid", "x", param="response_format.type")).param == "text.format.type"  # type: ignore[arg-type]


def test_store_false_keeps_no_input():
    assert wire.meta(_req(input="secret", store=False))["input"] == []
    assert wire.meta(_req(input="kept"))["input"] == [{"type": "message", "role": "user", "content": "kept"}]


# -- rendering -------------------------------------------------------------------------------------


def test_a_completed_job_is_a_response_object():
    r = render.response_of(_job(metadata={"a": "b"}, instructions="I"))
    assert r["id"] == "resp_0123456789abcdef01234567" and r["object"] == "response" and r["status"] == "completed"
    assert r["output"] == [
        {
            "id": r["output"][0]["id"],
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}],
        }
    ]
    assert r["output"][0]["id"].startswith("msg_")
    assert r["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    assert r["metadata"] == {"a": "b"} and r["instructions"] == "I" and r["store"] is True
    assert r["created_at"] == int(T0.timestamp()) and r["completed_at"] == int(T0.timestamp())


def test_the_sdk_parses_it_and_its_output_text_works():
    from openai.types.responses import Response

    parsed = Response.model_validate(render.response_of(_job()))
    assert parsed.output_text == "Hello there." and parsed.usage is not None


@pytest.mark.parametrize(
    ("state", "status"),
    [("queued", "queued"), ("dispatched", "queued"), ("running", "in_progress"), ("cancelled", "cancelled")],
)
def test_states_map_to_statuses(state, status):
    r = render.response_of(_job(state))
    assert r["status"] == status and r["output"] == [] and r["usage"] is None and r["error"] is None


def test_a_failed_job_carries_its_error_and_a_cut_one_is_incomplete():
    r = render.response_of(_job("failed"))
    assert r["status"] == "failed" and r["error"] == {"code": "engine_error", "message": "boom"}
    cut = render.response_of(_job(finish="length"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete" and cut["completed_at"] is None


def test_tool_calls_are_function_call_items_with_stable_ids():
    text = '<tool_call>\n{"name": "f", "arguments": {"c": "P"}}\n</tool_call>'
    r = render.response_of(_job(text=text, tools=True))
    (call,) = r["output"]
    assert call["type"] == "function_call" and call["name"] == "f" and call["arguments"] == '{"c": "P"}'
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert render.response_of(_job(text=text, tools=True))["output"] == r["output"]  # the same ids every time
    # As the next turn's chain: the call, as chat's assistant tool call with the same id.
    (msg,) = wire.chain_messages(_job(text=text, tools=True))[1:]
    assert msg["tool_calls"][0]["id"] == call["call_id"]


def _stream(job, evs) -> list[dict[str, Any]]:
    r = wire.Events(job)
    out = r.start()
    for ev in evs:
        out += r.render(ev)
    return out


def test_stream_events_in_order_with_sequence_numbers():
    job = _job()
    evs = [Delta(choice=0, text="Hel"), Delta(choice=0, text="lo"), Delta(choice=0, text="", finish_reason="stop")]
    out = _stream(job, [*evs, Done(usage=Usage(prompt_tokens=10, completion_tokens=3))])
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"
    assert out[-1]["response"]["output"][0]["id"] == out[2]["item"]["id"]
    assert out[-1]["response"]["usage"]["output_tokens"] == 3
    # Whatever reads the same events numbers them alike.
    assert (
        _stream(
            job, [*evs, Done(usage=Usage(prompt_tokens=10, completion_tokens=3), t=out[-1]["response"]["completed_at"])]
        )[:-1]
        == out[:-1]
    )


def test_stream_endings():
    job = _job(state="running")
    failed = _stream(job, [Failed(error=ErrorInfo(message="m", code="c"))])
    assert failed[-1]["type"] == "response.failed" and failed[-1]["response"]["error"] == {"code": "c", "message": "m"}
    cancelled = _stream(job, [Delta(choice=0, text="a"), Cancelled()])
    assert cancelled[-1]["type"] == "response.failed" and cancelled[-1]["response"]["status"] == "cancelled"
    cut = _stream(job, [Delta(choice=0, text="a", finish_reason="length"), Done(usage=Usage())])
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_background_stream_is_created_queued():
    out = wire.Events(_job(background=True)).start()
    assert out[0]["response"]["status"] == "queued" and out[1]["response"]["status"] == "in_progress"


def test_a_tool_call_streams_as_function_call_argument_events():
    job = _job(tools=True, tool_choice="required")
    text = '<tool_call>\n{"name": "f", "arguments": {"c": 1}}\n</tool_call>'
    out = _stream(
        job,
        [Delta(choice=0, text=text[:10]), Delta(choice=0, text=text[10:], finish_reason="stop"), Done(usage=Usage())],
    )
    kinds = [e["type"] for e in out]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert out[-1]["response"]["output"] == render.response_of(_job(text=text, tools=True))["output"]


def test_the_rows_text_is_cut_as_the_streams_deltas_were():
    marks = [(1, 0, 3, 0, False, False), (2, 0, 2, 0, False, False), (3, 0, 0, 0, False, True)]
    got = wire.rebuilt_deltas("Hello", "stop", marks)
    assert [(d.text, d.finish_reason) for d in got] == [("Hel", None), ("lo", None), ("", "stop")]
    assert [(d.text, d.finish_reason) for d in wire.rebuilt_deltas("Hello", "stop", [])] == [("Hello", "stop")]


def test_input_items_pages():
    job = _job()
    job.chat["response"]["input"] = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    items = wire.input_item_list(job)
    assert [i["content"][0]["text"] for i in items] == [f"m{i}" for i in range(5)]
    assert all(i["type"] == "message" and i["id"].startswith("msg_") for i in items)
    first = wire.page(items, None, None, 2, "asc")
    assert [d["content"][0]["text"] for d in first["data"]] == ["m0", "m1"] and first["has_more"]
    rest = wire.page(items, first["last_id"], None, 10, "asc")
    assert [d["content"][0]["text"] for d in rest["data"]] == ["m2", "m3", "m4"] and not rest["has_more"]
    assert wire.page(items, None, None, 1, "desc")["data"][0]["content"][0]["text"] == "m4"
