"""Issue 35: a stream resumed after any id the server sent, the last included, neither repeats nor
skips, whether the job's Redis stream still answers or (expired: an ended job's lives minutes) its
row in Postgres does. A resume after the last id gives only `[DONE]` (it used to replay the whole
answer again, without ids: a client that lost its connection just before `[DONE]` saw it twice).
"""

from __future__ import annotations

import openai
from openai.types import Completion

from core.infra.streams import keys
from tests.conftest import MODEL, job_row
from tests.sse import collect

ROW_MS = 10**18  # core/infra/streams/read.ROW_MS: ids of an answer the row gave


def _live(http) -> tuple[str, list[tuple[str | None, str]]]:
    """A streamed completion read to its end as it was generated: (job id, [(id, text)])."""
    req = {"model": MODEL, "prompt": "Count slowly: one, two,", "stream": True, "max_tokens": 40}
    req |= {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    out: list[tuple[str | None, str]] = []
    job_id = ""
    with http.stream("POST", "/v1/completions", json=req) as resp:
        assert resp.status_code == 200
        seen, done = collect(resp)
    assert done
    for ev in seen:
        job_id = ev.json["id"]
        out.append((ev.id, "".join(c["text"] for c in ev.json.get("choices", []))))
    return job_id, out


def _resume_raw(http, job_id: str, last_id: str) -> tuple[list, bool]:
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_id}) as resp:
        assert resp.status_code == 200, resp.read()
        return collect(resp)


def _resume_sdk(sdk: openai.OpenAI, job_id: str, last_id: str) -> str:
    """The same resume read by the openai SDK's own SSE decoder."""
    stream = sdk.get(
        f"/jobs/{job_id}/events",
        cast_to=Completion,
        options={"headers": {"Last-Event-ID": last_id}},
        stream=True,
        stream_cls=openai.Stream[Completion],
    )
    return "".join(c.text for chunk in stream for c in chunk.choices)


def _text(evs) -> str:
    return "".join(c["text"] for e in evs for c in e.json.get("choices", []))


def _resumed_after_each_id(http, sdk, job_id: str, live, whole: str, where: str) -> list[list]:
    """Resume after each id of the live stream, raw and through the SDK: each time, what came is the
    rest of `whole`, and after the last id only `[DONE]`. What came after each id but the last."""
    rests = []
    for k, (last_id, _) in enumerate(live):
        before = "".join(t for _, t in live[: k + 1])
        rest, done = _resume_raw(http, job_id, last_id)
        assert done
        assert before + _text(rest) == whole, f"resumed after {last_id} ({where})"
        assert before + _resume_sdk(sdk, job_id, last_id) == whole, f"SDK resumed after {last_id} ({where})"
        if k == len(live) - 1:
            assert rest == [], f"after the last id only [DONE], got {[e.data for e in rest]}"
        else:
            rests.append(rest)
    return rests


def test_a_resume_after_any_id_neither_repeats_nor_skips_from_the_stream_or_the_row(stack, db, rds):
    sdk = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.keys["alpha"], max_retries=0)
    with stack.http(stack.keys["alpha"]) as http:
        job_id, live = _live(http)
        whole = job_row(db, job_id)["result"]["choices"][0]["text"]
        assert "".join(t for _, t in live) == whole
        ids = [i for i, _ in live]
        assert len(ids) > 5 and all(ids), ids  # every event (the usage chunk last) carries an id

        # The stream is there: an ended job's is kept only minutes (SPOOL_ENDED_EVENTS_TTL_S).
        assert 0 < rds.ttl(keys.stream_key(job_id)) <= 300
        for rest in _resumed_after_each_id(http, sdk, job_id, live, whole, "stream"):
            assert rest[-1].json["usage"]["completion_tokens"] == 40  # the ending once, at the end

        # The stream expires; the row answers, and every id the stream gave still places the resume.
        rds.delete(keys.stream_key(job_id))
        row_ids: list[str] = []
        for rest in _resumed_after_each_id(http, sdk, job_id, live, whole, "row"):
            assert all(int(e.id.split("-")[0]) >= ROW_MS for e in rest)  # the row's answer has ids too
            row_ids = [e.id for e in rest]

        # ...and so does every id the row's own answer gave.
        rest, done = _resume_raw(http, job_id, "0-0")
        assert done and _text(rest) == whole
        for e in rest:
            upto = _text(rest[: rest.index(e) + 1])
            more, done = _resume_raw(http, job_id, e.id)
            assert done and upto + _text(more) == whole, f"resumed after the row's {e.id}"
        assert row_ids and _resume_raw(http, job_id, rest[-1].id) == ([], True)
