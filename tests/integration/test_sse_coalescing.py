"""Issue 26: a reader that fell behind gets the backlog in one write, each run of one choice's
tokens as one chunk, and resuming from any id it was given neither skips nor repeats a token."""

from __future__ import annotations

import asyncio

from core.generation.events import Delta, Done, Usage, encode
from core.infra import kv, streams
from core.jobs.stream import coalesce, follow_batches
from tests.integration.conftest import IT_REDIS


async def _no_row():
    return None


def _deltas(job_id: str, rds, n: int, choices: int = 1) -> list[str]:
    streams.raise_fence(rds, job_id, 1, 60)
    evs = [encode(Delta(attempt=1, choice=i % choices, text=f" w{i}", token_ids=[i])) for i in range(n)]
    end = encode(Done(attempt=1, usage=Usage(prompt_tokens=1, completion_tokens=n)))
    ids = streams.append_fenced(rds, job_id, 1, evs, 60, start=1)
    return [*ids, rds.xadd(streams.stream_key(job_id), {streams.FIELD: end}).decode()]


def _read(job_id: str, last_id: str = "0-0") -> list[list]:
    async def go() -> list[list]:
        hub = streams.Hub(kv.async_client(IT_REDIS, decode_responses=True))
        try:
            return [b async for b in follow_batches(hub, job_id, _no_row, last_id=last_id)]  # type: ignore[misc]
        finally:
            await hub.aclose()

    return asyncio.run(go())


def test_a_backlog_of_one_choice_is_one_chunk_under_its_last_id(rds):
    job_id = "coal-one"
    rds.delete(streams.stream_key(job_id))
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
    rds.delete(streams.stream_key(job_id))
    ids = _deltas(job_id, rds, 8, choices=2)  # choices alternate: nothing is consecutive
    out = coalesce(_read(job_id)[0])
    assert [e for e, _ in out] == ids  # nothing merged, every id kept in order
    # Resuming after any id a client was given delivers exactly the tokens after it.
    for k, resume_at in enumerate(ids[:-1]):
        rest = [ev for b in _read(job_id, resume_at) for _, ev in coalesce(b) if isinstance(ev, Delta)]
        assert [t for ev in rest for t in ev.token_ids] == list(range(k + 1, 8))
