"""The keep-alive between events is a comment line no SSE decoder turns into an event."""

from __future__ import annotations

from openai._streaming import SSEDecoder

from api.sse import sse, sse_comment


def test_keep_alives_after_an_event_id_are_no_events_for_the_openai_sdk():
    raw = sse({"a": 1}, "1-0") + sse_comment("keep-alive") + sse_comment("keep-alive") + sse({"b": 2}, "2-0")
    raw += sse("[DONE]")
    events = list(SSEDecoder().iter_bytes(iter([raw])))
    assert [(e.data, e.id) for e in events] == [('{"a":1}', "1-0"), ('{"b":2}', "2-0"), ("[DONE]", "2-0")]


def test_a_keep_alive_is_one_comment_line():
    assert sse_comment("keep-alive") == b": keep-alive\n"


def _eventsource(raw: bytes) -> list[tuple[str, str, str]]:
    """A browser EventSource's parsing, as the WHATWG HTML standard writes it (9.2.6, "Interpreting an
    event stream"): (type, data, lastEventId) of each dispatched message event."""
    text = raw.decode("utf-8")
    text = text[1:] if text.startswith("\ufeff") else text
    events: list[tuple[str, str, str]] = []
    data, etype, last_id = "", "", ""
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")[:-1]:  # an unended line is no line
        if line == "":  # dispatch: nothing when the data buffer is empty; the last event ID persists
            if data:
                events.append((etype or "message", data[:-1] if data.endswith("\n") else data, last_id))
            data, etype = "", ""
            continue
        if line.startswith(":"):
            continue  # a comment
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data += value + "\n"
        elif name == "event":
            etype = value
        elif name == "id" and "\0" not in value:
            last_id = value
    return events


def test_a_browser_eventsource_gets_every_event_and_id_and_no_keep_alive():
    raw = sse({"a": 1}, "1-0") + sse_comment("keep-alive") + sse({"b": 2}, "2-0") + sse_comment("keep-alive")
    raw += sse("[DONE]")
    assert _eventsource(raw) == [
        ("message", '{"a":1}', "1-0"),
        ("message", '{"b":2}', "2-0"),
        ("message", "[DONE]", "2-0"),
    ]


def test_coalesce_keeps_echo_finish_and_scores_boundaries():
    from core.generation.events import Delta, TokenScore
    from core.jobs.follow import coalesce

    s = TokenScore(id=1, text="a", logprob=-1.0)
    echo = Delta(choice=0, text="Hi a", token_ids=[1], prefix_len=2, scores=[s])
    more = Delta(choice=0, text="a", token_ids=[2], scores=[s])
    end = Delta(choice=0, text="a", token_ids=[3], scores=[s], finish_reason="stop", eos=True)
    after = Delta(choice=0, text="x", token_ids=[4], scores=[s])  # never merged into a finished run
    out = coalesce([("0-1", echo), ("0-2", more), ("0-3", end), ("0-4", after)])
    assert [i for i, _ in out] == ["0-3", "0-4"]
    merged = out[0][1]
    assert isinstance(merged, Delta)
    assert (merged.text, merged.prefix_len, merged.token_ids) == ("Hi aaa", 2, [1, 2, 3])
    assert merged.scores == [s, s, s] and merged.finish_reason == "stop" and merged.eos
    # A delta that carries an echoed prompt starts a run of its own.
    out = coalesce([("0-1", more), ("0-2", echo)])
    assert [i for i, _ in out] == ["0-1", "0-2"]


def test_a_stream_whose_last_write_carries_done_after_other_chunks_was_read_to_its_end():
    """A reader that fell behind gets the last tokens, the usage chunk and `[DONE]` in one write: a
    client closing after it read everything, so its job must not be cancelled after the grace period
    (it was, for every such stream: a cancel query per job)."""
    import asyncio

    from api.routes.completions import _DONE, _StreamOrCancel

    async def writes():
        yield sse({"a": 1}, "0-1")
        yield sse({"b": 2}, "0-2") + sse({"usage": {}}) + _DONE

    resp = _StreamOrCancel(writes(), "job", 1, None, None, None)  # type: ignore[arg-type]

    async def drain() -> None:
        async for _ in resp.body_iterator:
            pass

    asyncio.run(drain())
    assert resp.ended
