"""The Responses API (`/v1/responses`) on the durable job path, with the official `openai` client
against the real SmolLM2 (135M: its answers are poor, so these assert shapes, plumbing and exactness,
not quality): create, stream, JSON schema, a function tool round trip, background responses polled,
cancelled and rejoined, chains of `previous_response_id`, delete, tenancy and `store: false`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from sqlalchemy import text

from tests.conftest import MODEL, job_row, wait_for
from tests.helpers import batch_file

SYSTEM = "You are a helpful assistant."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def _job_id(resp_id: str) -> str:
    return "cmpl-" + resp_id.removeprefix("resp_")


def _events(stack, tenant: str = "alpha", path: str = "/v1/responses", method: str = "POST", **body):
    """(event name, data) of a response's SSE stream, read raw."""
    out = []
    with (
        stack.http(stack.keys[tenant]) as http,
        http.stream(method, path, json=body if method == "POST" else None) as r,
    ):
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append(data)
    return out


def test_a_plain_response_has_openais_shape_and_output_text(stack):
    client = stack.openai()
    r = client.responses.create(
        model=MODEL,
        instructions=SYSTEM,
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=20,
        metadata={"case": "plain"},
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert r.output and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text and r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 20
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == SYSTEM and r.metadata == {"case": "plain"} and r.temperature == 0
    assert r.max_output_tokens == 20 and r.model == MODEL and r.store is True
    # The same job, read back: retrieve answers the same object.
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == r.status and again.usage == r.usage


def test_max_output_tokens_makes_an_incomplete_response(stack):
    r = stack.openai().responses.create(
        model=MODEL, input="Write a long story about a dragon.", max_output_tokens=3, temperature=0
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_a_streamed_response_emits_openais_events_in_order(stack):
    client = stack.openai()
    with client.responses.stream(
        model=MODEL, instructions=SYSTEM, input="Name three colors.", temperature=0, max_output_tokens=200
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == "response.completed"
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(events)))  # strictly increasing, from 0, none missing
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    # The same job unstreamed (greedy): the same text.
    r = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="Name three colors.", temperature=0, max_output_tokens=200
    )
    assert r.output_text == text
    assert client.responses.retrieve(final.id).output_text == text


def test_a_json_schema_format_gives_valid_json(stack):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = stack.openai().responses.create(
        model=MODEL,
        input="Make up a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60,
    )
    data = json.loads(r.output_text)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)
    assert r.text.format.type == "json_schema"


def test_a_function_tool_round_trip(stack):
    client = stack.openai()
    r = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert r.tools[0].name == "get_weather"
    # The tool's answer goes back as `function_call_output`, chained on the first response.
    r2 = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 21}'}],
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
    )
    assert r2.status in ("completed", "incomplete") and r2.previous_response_id == r.id
    # ... and the same turn without the chain: the call and its output as input items. The prompt is
    # the same conversation, so its size is the same.
    r3 = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 21}'},
        ],
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
    )
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.output_text == r2.output_text


def test_a_function_call_streams_as_argument_events(stack):
    events = _events(
        stack,
        model=MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,  # sampled, the model once chose an empty city (2026-11-28): what streams is the point
        stream=True,
    )
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"])["city"]
    final = events[-1]["response"]
    assert final["output"][-1]["type"] == "function_call" and final["output"][-1]["arguments"] == done["arguments"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_background_create_poll_completed(stack):
    client = stack.openai()
    r = client.responses.create(model=MODEL, input="Say hello.", background=True, max_output_tokens=16)
    assert r.status in ("queued", "in_progress") and r.background is True and r.output == []
    got = wait_for(
        lambda: (x := client.responses.retrieve(r.id)).status in ("completed", "incomplete") and x, 60, "completed"
    )
    assert got.output_text and got.usage.output_tokens > 0


def test_cancel_a_running_background_response(stack, db, rds):
    key = stack.new_tenant("resp-cancels")
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
    r = client.responses.create(
        model=MODEL,
        input="Count from one to one thousand.",
        background=True,
        max_output_tokens=900,
        extra_body={"ignore_eos": True},  # Spool's extension, as on chat: it runs long enough to cancel
    )
    job_id = _job_id(r.id)
    # A few tokens out before the cancel, which bills them (a fixed sleep saw none on a loaded host).
    wait_for(lambda: rds.xlen(f"job:{job_id}:events") >= 3, 60, "some tokens streamed")
    c = client.responses.cancel(r.id)
    assert c.status == "cancelled"
    assert job_row(db, job_id)["state"] == "cancelled"
    with db.connect() as conn:
        billed = conn.execute(
            text(
                "SELECT sum(u.completion_tokens) FROM usage_daily u JOIN tenants t ON t.id = u.tenant_id "
                "WHERE t.name = 'resp-cancels'"
            )
        ).scalar()
    assert 0 < billed < 900
    # The cancelled response shows what it generated: the usage billed, and the text so far, kept on
    # the row by the cancel (read back after its stream is gone too).
    for seen in (c, client.responses.retrieve(r.id)):
        assert seen.status == "cancelled" and seen.usage is not None
        assert seen.usage.output_tokens == billed and seen.usage.input_tokens > 0
        assert seen.output and seen.output[0].type == "message" and seen.output[0].status == "incomplete"
        assert seen.output_text and seen.output_text == c.output_text


def test_previous_response_id_three_turns_deep(stack):
    client = stack.openai()
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="My name is Ada.", max_output_tokens=10, temperature=0
    )
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="I live in Paris.", max_output_tokens=10, temperature=0
    )
    third = client.responses.create(
        model=MODEL, previous_response_id=second.id, input="What is my name?", max_output_tokens=10, temperature=0
    )
    # The third prompt is the whole conversation: every earlier input and output, then the new input.
    flat = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "I live in Paris."},
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_output_tokens=10,
        temperature=0,
    )
    assert third.usage.input_tokens == flat.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    assert third.output_text == flat.output_text
    items = client.responses.input_items.list(third.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]


def test_input_items_are_listed_and_paginated(stack):
    client = stack.openai()
    inputs = [{"role": "user", "content": f"Line {i}."} for i in range(5)]
    r = client.responses.create(model=MODEL, input=inputs, max_output_tokens=2)
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["Line 0.", "Line 1."] and page.has_more
    texts = [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc", limit=2)]  # auto-paginates
    assert texts == [f"Line {i}." for i in range(5)]
    newest = client.responses.input_items.list(r.id, limit=1)
    assert newest.data[0].content[0].text == "Line 4."


def test_delete_then_404(stack):
    client = stack.openai()
    r = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4)
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=r.id, input="Again.", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_another_tenants_response_is_404(stack):
    r = stack.openai("alpha").responses.create(model=MODEL, input="Hi.", max_output_tokens=4)
    beta = stack.openai("beta")
    for call in (
        lambda: beta.responses.retrieve(r.id),
        lambda: beta.responses.cancel(r.id),
        lambda: beta.responses.delete(r.id),
        lambda: beta.responses.input_items.list(r.id),
        lambda: beta.responses.create(model=MODEL, previous_response_id=r.id, input="x", max_output_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] in ("not_found", "response_not_found")
    assert stack.openai("alpha").responses.retrieve(r.id).id == r.id


def test_store_false_is_not_retrievable(stack):
    client = stack.openai()
    r = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, store=False)
    assert r.status in ("completed", "incomplete") and r.store is False and r.output
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=r.id, input="Again.", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi.", store=False, background=True)
    assert e.value.body["param"] == "background"


def test_a_stream_rejoined_with_starting_after_equals_an_unbroken_run(stack):
    client = stack.openai()
    r = client.responses.create(
        model=MODEL, input="Tell me about the sea.", background=True, max_output_tokens=40, temperature=0
    )
    unbroken = _events(stack, path=f"/v1/responses/{r.id}?stream=true", method="GET")
    assert [e["sequence_number"] for e in unbroken] == list(range(len(unbroken)))
    assert unbroken[0]["response"]["status"] == "queued"  # a background response is created queued
    for n in (0, 3, len(unbroken) // 2, len(unbroken) - 2):
        rest = _events(stack, path=f"/v1/responses/{r.id}?stream=true&starting_after={n}", method="GET")
        assert rest == unbroken[n + 1 :]
    # The SDK's own rejoin.
    with client.responses.retrieve(r.id, stream=True, starting_after=4) as s:
        got = [e.sequence_number for e in s]
    assert got == list(range(5, len(unbroken)))
    text = "".join(e["delta"] for e in unbroken if e["type"] == "response.output_text.delta")
    assert text == client.responses.retrieve(r.id).output_text


def test_a_rejoin_after_the_stream_expired_numbers_events_alike(stack, rds):
    r = stack.openai().responses.create(model=MODEL, input="Tell me a joke.", max_output_tokens=30, temperature=0)
    live = _events(stack, path=f"/v1/responses/{r.id}?stream=true", method="GET")
    rds.delete(f"job:{_job_id(r.id)}:events")  # as if its ended stream had expired: the row answers
    rebuilt = _events(stack, path=f"/v1/responses/{r.id}?stream=true", method="GET")
    assert [(e["type"], e["sequence_number"], e.get("delta")) for e in rebuilt] == [
        (e["type"], e["sequence_number"], e.get("delta")) for e in live
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": "x", "previous_response_id": "resp_nothex"}, "previous_response_id"),
    ],
)
def test_what_spool_cannot_do_is_a_400_naming_the_field(stack, body, param):
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_spool_sampling_extensions_pass_through_and_idempotency_keys_replay(stack):
    body = {"model": MODEL, "input": "Pick a number.", "max_output_tokens": 5, "seed": 7, "top_k": 1}
    with stack.http(stack.keys["alpha"]) as http:
        a = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "resp-key-1"})
        b = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "resp-key-1"})
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["id"] == b.json()["id"] and b.headers.get("idempotent-replayed") == "true"
    assert a.json()["output"] == b.json()["output"]
    with stack.http(stack.keys["alpha"]) as http:  # the same key with other Responses settings: refused
        c = http.post("/v1/responses", json={**body, "metadata": {"k": "v"}}, headers={"Idempotency-Key": "resp-key-1"})
    assert c.status_code == 422, c.text


def test_a_response_is_a_job(stack):
    r = stack.openai().responses.create(model=MODEL, input="Hi.", max_output_tokens=4)
    with stack.http(stack.keys["alpha"]) as http:
        job = http.get(f"/v1/jobs/{_job_id(r.id)}").json()
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == r.usage.output_tokens


def test_unauthenticated_is_401(stack):
    r = httpx.post(stack.base_url + "/v1/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 401


def _first_events(stack, resp_id: str, n: int) -> list[dict]:
    """The first `n` events of a response's stream, then hang up."""
    out: list[dict] = []
    with (
        stack.http(stack.keys["alpha"]) as http,
        http.stream("GET", f"/v1/responses/{resp_id}?stream=true") as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) >= n:
                    break
    return out


def test_a_background_stream_rejoined_after_a_worker_kill_and_an_api_restart_equals_an_unbroken_run(stack, db, rds):
    import signal

    body = {
        "model": MODEL,
        "input": "Write about rivers.",
        "background": True,
        "max_output_tokens": 160,
        "temperature": 0,
        "ignore_eos": True,  # long enough to be killed mid-way
    }
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post("/v1/responses", json=body).json()
    job_id = _job_id(r["id"])
    wait_for(lambda: rds.xlen(f"job:{job_id}:events") >= 8, 60, "some tokens streamed")
    stack.kill_worker()
    before = _first_events(stack, r["id"], 8)  # what a client read before it lost its connection
    stack.start_worker()  # the reaper requeues the job; the next attempt resumes from the streamed tokens
    after_kill = _events(stack, path=f"/v1/responses/{r['id']}?stream=true&starting_after=7", method="GET")
    # And once more after an API restart, from further on.
    stack.signal("api", signal.SIGTERM)
    stack.start_api()
    m = len(before) + len(after_kill) // 2
    after_restart = _events(stack, path=f"/v1/responses/{r['id']}?stream=true&starting_after={m}", method="GET")
    whole = before + after_kill
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[m + 1 :] == after_restart
    assert job_row(db, job_id)["attempt"] >= 2
    text = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
    # An unbroken run of the same greedy request gives the same text.
    with stack.http(stack.keys["alpha"]) as http:
        unbroken = http.post("/v1/responses", json={**body, "background": False}).json()
    assert whole[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert text == unbroken["output"][0]["content"][0]["text"]


def test_a_responses_batch_through_the_sdk_answers_response_objects(stack):
    """`/v1/responses` as a Batch API endpoint: each line runs as a response; the output file's
    bodies are `response` objects the SDK parses."""
    import io

    from openai.types.responses import Response

    client = stack.openai()
    base = {"model": MODEL, "instructions": SYSTEM, "max_output_tokens": 8, "temperature": 0}
    bodies = [
        {**base, "input": p, "metadata": {"line": str(i)}} for i, p in enumerate(["Say hello.", "Name a colour."])
    ]
    raw = batch_file("/v1/responses", {f"resp-{i}": body for i, body in enumerate(bodies)})
    f = client.files.create(file=("responses.jsonl", io.BytesIO(raw)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    assert b.endpoint == "/v1/responses"
    b = wait_for(
        lambda: (x := client.batches.retrieve(b.id)).status in ("completed", "failed") and x, 120, "batch ended"
    )
    assert b.status == "completed", b.errors
    assert b.request_counts.completed == 2 and b.request_counts.failed == 0
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["resp-0", "resp-1"]
    for i, o in enumerate(out):
        assert o["response"]["status_code"] == 200 and o["error"] is None
        r = Response.model_validate(o["response"]["body"])
        assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
        assert r.output_text and r.metadata == {"line": str(i)} and r.instructions == SYSTEM
        assert 0 < r.usage.output_tokens <= 8
        # The same as one sent alone, greedy: the batch line ran the same request.
        alone = client.responses.create(**bodies[i])
        assert r.output_text == alone.output_text
        # A line's response is stored as any response is.
        assert client.responses.retrieve(r.id).output_text == r.output_text


def test_a_chains_second_turn_reuses_the_first_turns_prefix(stack):
    """Prefix reuse across turns of one chain shows in `cached_tokens`: the second turn's prompt
    starts with the first turn's (instructions, input and answer through the chat template), which
    the engine's prefix cache (one tenant's slot) still holds."""
    client = stack.openai()
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="My name is Ada. Remember it.", max_output_tokens=12, temperature=0
    )
    assert first.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    second = client.responses.create(
        model=MODEL,
        instructions=SYSTEM,
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > 0, second.usage
    # At least the first turn's whole prompt was reused (its answer may be tokenized apart).
    assert first.usage.input_tokens <= cached < second.usage.input_tokens
    assert client.responses.retrieve(second.id).usage.input_tokens_details.cached_tokens == cached
