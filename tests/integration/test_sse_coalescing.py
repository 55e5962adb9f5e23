"""Issue 26: a reader that fell behind gets the backlog in one write, each run of one choice's
tokens as one chunk, and resuming from any id it was given neither skips nor repeats a token."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from core.generation.events import Delta, Done, Failed, TokenScore, Usage, encode
from core.infra import kv
from core.infra.streams import keys, read, write
from core.jobs.follow import ENDED, HEARTBEAT, coalesce, follow_grouped
from tests.integration.conftest import IT_REDIS


async def _no_row():
    return None


def _deltas(job_id: str, rds, n: int, choices: int = 1) -> list[str]:
    write.raise_fence(rds, job_id, 1, 60)
    evs = [encode(Delta(attempt=1, choice=i % choices, text=f" w{i}", token_ids=[i])) for i in range(n)]
    end = encode(Done(attempt=1, usage=Usage(prompt_tokens=1, completion_tokens=n)))
    ids = write.append_fenced(rds, job_id, 1, evs, 60, start=1)
    return [*ids, rds.xadd(keys.stream_key(job_id), {keys.FIELD: end}).decode()]


def _read(job_id: str, last_id: str = "0-0") -> list[list]:
    async def go() -> list[list]:
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=200)
        try:
            return [b async for b in follow_grouped(hub, job_id, _no_row, last_id=last_id)]  # type: ignore[misc]
        finally:
            await hub.aclose()

    return asyncio.run(go())


def test_a_backlog_of_one_choice_is_one_chunk_under_its_last_id(rds):
    job_id = "coal-one"
    rds.delete(keys.stream_key(job_id))
    ids = _deltas(job_id, rds, 12)
    batches = _read(job_id)
    assert len(batches) == 1 and len(batches[0]) == 13  # all there when the reader asked
    out = coalesce(batches[0])
    assert len(out) == 2  # one delta for the twelve tokens, then the end
    (first_id, merged), (_, done) = out
    assert isinstance(merged, Delta) and isinstance(done, Done)
    assert merged.text == "".join(f" w{i}" for i in range(12)) and merged.token_ids == list(range(12))
    assert first_id == ids[11]  # the id of the last token it carries


def test_interleaved_choices_merge_only_consecutive_runs_and_every_id_resumes_exactly(rds):
    job_id = "coal-two"
    rds.delete(keys.stream_key(job_id))
    ids = _deltas(job_id, rds, 8, choices=2)  # choices alternate: nothing is consecutive
    out = coalesce(_read(job_id)[0])
    assert [e for e, _ in out] == ids  # nothing merged, every id kept in order
    # Resuming after any id a client was given delivers exactly the tokens after it.
    for k, resume_at in enumerate(ids[:-1]):
        rest = [ev for b in _read(job_id, resume_at) for _, ev in coalesce(b) if isinstance(ev, Delta)]
        assert [t for ev in rest for t in ev.token_ids] == list(range(k + 1, 8))


# -- issue 35: a resume after any id the server sent, including the last, neither repeats nor skips,
# whether the stream still answers or, once it has expired, the job row does ------------------------

ENDED_TTL_S = 300
WORDS = [" héllo", " wörld", " 日本", " 🎉!", " plain", " tail"]


def _score(i: int) -> TokenScore:
    return TokenScore(id=i, text=f"t{i}", logprob=-0.5 * i, offset=i)


def _job(rds, job_id: str, choices: int = 1, scored: bool = False) -> tuple[SimpleNamespace, list[str]]:
    """A job that streamed `WORDS` per choice (interleaved, the last delta of each with its
    finish_reason) and ended as the worker and Lifecycle end it: deltas by the fenced append, its
    marks read for its row (`marks_of`), the terminal event by `queue_end`. Returns its row and the
    ids its stream gave."""
    for key in (keys.stream_key(job_id), keys.marks_key(job_id)):
        rds.delete(key)
    write.raise_fence(rds, job_id, 1, 60)
    evs, texts, scores = [], {c: "" for c in range(choices)}, {c: [] for c in range(choices)}
    for i, w in enumerate(WORDS):
        for c in range(choices):
            last = i == len(WORDS) - 1
            sc = [_score(i)] if scored else None
            evs.append(
                Delta(attempt=1, choice=c, text=w, token_ids=[i], finish_reason="length" if last else None, scores=sc)
            )
            texts[c] += w
            scores[c] += sc or []
    ids = write.append_fenced(rds, job_id, 1, [encode(e) for e in evs], 3600, start=1)
    usage = Usage(prompt_tokens=2, completion_tokens=len(evs))
    marks = write.marks_of(rds, job_id)
    pipe = rds.pipeline(transaction=False)
    write.queue_end(pipe, job_id, 1, [encode(Done(attempt=1, usage=usage))], ENDED_TTL_S)
    ids.append(pipe.execute()[-1][0].decode())
    result = {
        "choices": [
            {
                "index": c,
                "text": texts[c],
                "finish_reason": "length",
                "scores": [s.model_dump() for s in scores[c]] if scored else None,
            }
            for c in range(choices)
        ]
    }
    row = SimpleNamespace(state="succeeded", result=result, usage=usage.model_dump(), error=None, marks=marks)
    return row, ids


def _read_all(job_id: str, row, last_id: str = "0-0") -> list[tuple[str | None, object]]:
    async def check():
        return row

    async def go() -> list:
        # A short shared read: closing the hub waits for the read in flight.
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=200)
        try:
            out = []
            async for b in follow_grouped(hub, job_id, check, last_id=last_id, block_ms=300):
                if b is not HEARTBEAT:
                    out += b  # type: ignore[operator]
            return out
        finally:
            await hub.aclose()

    return asyncio.run(go())


def _texts(events) -> dict[int, str]:
    out: dict[int, str] = {}
    for _, ev in events:
        if isinstance(ev, Delta):
            out[ev.choice] = out.get(ev.choice, "") + ev.text
    return out


def _check_every_resume(job_id: str, row, choices: int) -> None:
    """From the start, and after each id a reader is given: what it saw up to the id plus what a
    resume from it gives is the whole answer, each finish_reason once, and after the last id only
    the end."""
    whole = {c["index"]: c["text"] for c in row.result["choices"]}
    full = _read_all(job_id, row)
    assert _texts(full) == whole
    assert isinstance(full[-1][1], Done)
    ids = [i for i, _ in full]
    assert all(i is not None for i in ids)  # every event can be resumed from
    for k, resume_at in enumerate(ids):
        seen, rest = full[: k + 1], _read_all(job_id, row, resume_at)
        if k == len(ids) - 1:
            assert [ev for _, ev in rest] == [ENDED], f"after the last id {resume_at}: {rest}"
            continue
        got = _texts(seen)
        for c, t in _texts(rest).items():
            got[c] = got.get(c, "") + t
        assert got == whole, f"resumed after {resume_at}"
        finishes = [ev.choice for _, ev in seen + rest if isinstance(ev, Delta) and ev.finish_reason]
        assert sorted(finishes) == list(range(choices)), f"resumed after {resume_at}: finishes {finishes}"
        assert sum(isinstance(ev, Done) for _, ev in rest) == 1


def test_a_resume_after_the_last_id_gives_only_the_end_while_the_stream_is_there(rds):
    row, ids = _job(rds, "resume-live")
    rest = _read_all("resume-live", row, ids[-1])
    assert [ev for _, ev in rest] == [ENDED]  # the old code replayed the whole answer here, without ids
    _check_every_resume("resume-live", row, 1)


def test_the_end_shortens_the_stream_and_its_marks_are_for_the_row(rds):
    row, _ = _job(rds, "resume-ttl")
    assert 0 < rds.ttl(keys.stream_key("resume-ttl")) <= ENDED_TTL_S
    # Issue 49: the marks were kept in Redis a day, then as long as the stream: now on the row only.
    assert not rds.exists(keys.marks_key("resume-ttl"))
    assert write.marks_of(rds, "resume-ttl") == row.marks  # the terminal event has no mark
    marks = read.parse_marks(row.marks)
    # Characters as Python counts them (" 日本" is 3, " 🎉!" is 3), the last with its finish.
    assert [(m[0], m[2], m[5]) for m in marks] == [(i + 1, len(w), i == len(WORDS) - 1) for i, w in enumerate(WORDS)]


def test_every_stream_id_resumes_exactly_from_the_row_once_the_stream_has_expired(rds):
    row, ids = _job(rds, "resume-row", choices=2, scored=True)
    full = _read_all("resume-row", row)
    rds.delete(keys.stream_key("resume-row"))  # what its (shortened) TTL does
    whole = {c["index"]: c["text"] for c in row.result["choices"]}
    for k, resume_at in enumerate(ids):
        seen, rest = full[: k + 1], _read_all("resume-row", row, resume_at)
        if k == len(ids) - 1:
            assert [ev for _, ev in rest] == [ENDED]
            continue
        got = _texts(seen)
        for c, t in _texts(rest).items():
            got[c] = got.get(c, "") + t
        assert got == whole, f"resumed from the row after {resume_at}"
        # Scores neither repeated nor skipped either.
        for c in whole:
            mine = [s.id for _, ev in seen + rest if isinstance(ev, Delta) and ev.choice == c for s in ev.scores or []]
            assert mine == list(range(len(WORDS))), f"choice {c} after {resume_at}: {mine}"
    # The row's own answer carries ids, and a resume from each of them is exact too.
    _check_every_resume("resume-row", row, 2)
    from_row = _read_all("resume-row", row, ids[3])
    assert all(i is not None and int(i.split("-")[0]) == read.ROW_MS + 4 for i, _ in from_row)


def test_a_place_no_longer_known_is_an_error_not_a_repeat(rds):
    row, ids = _job(rds, "resume-lost")
    rds.delete(keys.stream_key("resume-lost"))
    row.marks = None  # a row that kept none (its end could not read the stream)
    rest = _read_all("resume-lost", row, ids[2])
    assert len(rest) == 1 and isinstance(rest[0][1], Failed) and rest[0][1].error.code == "resume_expired"
    assert _texts(_read_all("resume-lost", row)) == {0: "".join(WORDS)}  # from the start: the whole row
