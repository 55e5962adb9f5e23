"""Following a job's event stream (Redis) until its end, answered by Postgres when it is gone.

Every id a reader is given names a place it can resume from (`Last-Event-ID`), whichever answered:

- `0-<n>`: the stream's n-th entry (a delta; core/infra/streams/write.py numbers them). After it comes
  what the stream holds after it; once the stream is gone (an ended job's lives only minutes), what
  the job row holds after the text its first n entries carried, found from the marks its row kept
  when the job ended (`Job.marks`, `write.marks_of`), or from the stream itself while it is there.
- `<ms>-<s>` with 0 < ms < `read.ROW_MS`: a terminal event's (time-based, above every position).
  Only the end (`[DONE]`) is left after it.
- `<ROW_MS + n>-<k>`: an answer the row gave after the stream's first n entries, through its k-th
  event (the events `from_row` rebuilds, in order: each choice's text, then the ending). After it
  come that answer's events from the (k+1)-th on. Rebuilt the same way every time: the row of an
  ended job does not change.

A place the server can no longer find (an id it never gave, or one of a job whose row kept no marks
once its stream expired, `ended_events_ttl_s` after it ended) is answered with an error event, never
by repeating the answer. A job that never ran (cancelled or expired while queued, failed before its
first token) wrote no stream at all: its row answers, at once for a reader that knew it had ended, at
the first silence for one that was already following it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import anyio

from core.generation.events import Delta, ErrorInfo, Event, Failed, TerminalRow, decode, from_row, is_terminal
from core.infra.streams import read
from core.infra.transient import TRANSIENT

RowCheck = Callable[[], Awaitable[TerminalRow | None]]
HEARTBEAT = object()
Seen = dict[int, tuple[int, int, bool, bool]]  # per choice: characters, scores, echoed prompt, finish_reason delivered

# Decoding more entries than this at once (a replay's backlog) is done on a worker thread: 16k
# deltas with logprobs are a second of pydantic, and the event loop serves every other stream.
OFF_LOOP_ENTRIES = 256


class Ended:
    """A resume after the job's terminal event: nothing is left to send but the end (`[DONE]`)."""


ENDED = Ended()


def _unplaceable(last_id: str) -> Failed:
    return Failed(
        error=ErrorInfo(
            message=f"Last-Event-ID {last_id!r} no longer names a place in this job's output: its event log "
            "has expired. GET /v1/jobs/{id} has the whole result.",
            type="invalid_request_error",
            param="Last-Event-ID",
            code="resume_expired",
        )
    )


def _split(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def follow(
    reader: read.Reader, job_id: str, check_row: RowCheck, last_id: str = "0-0", block_ms: int = 2000
) -> AsyncIterator[tuple[str | None, Event | Ended] | object]:
    """Yield (entry id, event) from `last_id` on until a terminal event (or ENDED). When the stream
    is silent, yield HEARTBEAT and consult Postgres, which answers if the stream expired or was never
    written (a job that failed before its worker started, say)."""
    async with contextlib.aclosing(follow_grouped(reader, job_id, check_row, last_id, block_ms)) as groups:
        async for group in groups:
            if group is HEARTBEAT:
                yield HEARTBEAT
                continue
            for item in group:  # type: ignore[union-attr]
                yield item


async def decode_all(raws: list[str]) -> list[Event]:
    """Payloads as events; a large backlog on a worker thread."""
    if len(raws) <= OFF_LOOP_ENTRIES:
        return [decode(r) for r in raws]
    return await anyio.to_thread.run_sync(lambda: [decode(r) for r in raws])


def _add(seen: Seen, choice: int, chars: int, scores: int, prefix: bool, finished: bool) -> None:
    c0, s0, p0, f0 = seen.get(choice, (0, 0, False, False))
    seen[choice] = (c0 + chars, s0 + scores, p0 or prefix, f0 or finished)


def _count(seen: Seen, ev: Delta) -> None:
    _add(seen, ev.choice, len(ev.text), len(ev.scores or []), ev.prefix_len is not None, ev.finish_reason is not None)


# A group of this many payload bytes (or OFF_LOOP_ENTRIES entries) is heavy: a replay's backlog.
HEAVY_BYTES = 256 * 1024
# Backlog entries a reader pulls in one page before it joins the shared read of live tails.
PAGE = 500


def _no_gate() -> contextlib.AbstractAsyncContextManager[None]:
    return contextlib.nullcontext()


async def follow_grouped(
    reader: read.Reader,
    job_id: str,
    check_row: RowCheck,
    last_id: str = "0-0",
    block_ms: int = 2000,
    heavy: Callable[[], contextlib.AbstractAsyncContextManager[None]] = _no_gate,
    ended: bool = False,
) -> AsyncGenerator[list[tuple[str | None, Event | Ended]] | object, None]:
    """`follow`, as lists of what had arrived when asked (more than one event: the caller is behind).

    A heavy group (a backlog, or an ended job's rest from its row) is decoded, and handed on, inside
    `heavy()`: held until the caller asks for the next group, so the caller's framing and sending of
    it count too. The API passes its per-tenant gate, so one tenant's 200 replays of a long job decode
    and hold a few backlogs at a time, not 200 (on the loop's GIL and in memory).

    `ended`: the caller saw the job's row ended. A stream with nothing after `last_id` then means the
    row answers at once (a job that never ran wrote no stream; an ended job's expires), not after
    `block_ms` of silence."""
    live: Seen = {}  # what this reader was given from the stream
    at = last_id  # the last place it was given
    ms, seq = _split(last_id)

    async def group_of(entries: list[tuple[str, str]]) -> tuple[list[Any], bool]:
        nonlocal at
        out: list[tuple[str | None, Event | Ended]] = []
        for (entry_id, _), ev in zip(entries, await decode_all([raw for _, raw in entries]), strict=True):
            if isinstance(ev, Delta):
                _count(live, ev)
            out.append((entry_id, ev))
            at = entry_id
            if is_terminal(ev):
                return out, True
        return out, False

    # The ended job's row, once it answers: after every entry of the stream, or a resume into a stream
    # that is gone, at once (not after a silence); else once the stream has nothing more to give.
    row = await check_row() if ms > 0 or (seq > 0 and not await reader.exists(job_id)) else None
    if row is None:
        # The backlog first, in pages this reader pulls alone and only as its caller asks (each inside
        # `heavy()`): the shared read serves live tails, so one tenant's 200 replays of a long job are
        # never re-read, parsed and queued for every follower of the process at once.
        # Nothing of a page is kept while waiting for the gate again: 200 replays waiting there each
        # held their last decoded page (+680 MiB in the API) when these names outlived the block.
        pos = last_id
        while True:
            async with heavy():
                try:
                    page = await reader.page(job_id, pos, PAGE)
                except TRANSIENT:
                    page = []  # Redis away: the shared read below waits it out and tells the silence
                full, pos = len(page) == PAGE, page[-1][0] if page else pos
                if page:
                    out, ended = await group_of(page)
                    del page
                    yield out
                    del out
                    if ended:
                        return
                page = []
            if not full:
                break
        if ended and at == last_id:
            row = await check_row()
    if row is None:
        if at != last_id:
            pos = at
        async with contextlib.aclosing(reader.read_grouped(job_id, pos, block_ms)) as reading:
            async for entries in reading:
                if entries is None:
                    row = await check_row()
                    if row is not None:
                        break
                    yield HEARTBEAT
                    continue
                big = len(entries) > OFF_LOOP_ENTRIES or sum(len(raw) for _, raw in entries) > HEAVY_BYTES
                async with heavy() if big else _no_gate():
                    out, ended = await group_of(entries)
                    del entries
                    yield out
                    del out
                if ended:
                    return
    if row is not None:
        async with heavy():
            rest = await _rest(reader, job_id, row, last_id, at, live)
            if rest:
                yield rest


async def _rest(
    reader: read.Reader, job_id: str, row: TerminalRow, last_id: str, at: str, live: Seen
) -> list[tuple[str | None, Event | Ended]]:
    """What a reader that started after `last_id`, and was given `live` from the stream up to `at`,
    has not had of an ended job's row: each event under its row id (see the module's docstring)."""
    ms, seq = _split(last_id)
    if 0 < ms < read.ROW_MS:
        return [(None, ENDED)]
    start, skip = (seq, 0) if ms == 0 else (ms - read.ROW_MS, seq)
    seen = await place(reader, job_id, start, row_marks(row) if start else None)
    if seen is None:
        return [(None, _unplaceable(last_id))]
    for choice, counts in live.items():
        _add(seen, choice, *counts)
    a_ms, a_seq = _split(at)
    after = a_seq if a_ms == 0 else start  # the stream's entries this answer comes after
    rebuilt = [_unseen(ev, seen) for ev in from_row(row)]
    if skip >= len(rebuilt):  # its ending was delivered too
        return [(None, ENDED)]
    return [(f"{read.ROW_MS + after}-{k}", ev) for k, ev in enumerate(rebuilt, 1) if ev is not None and k > skip]


def row_marks(row: Any) -> list[read.Mark] | None:
    """The marks an ended job's row kept (`Job.marks`), None when it has none (it streamed nothing,
    or ended before rows kept them: an older Spool kept them in Redis, `Reader.marks`)."""
    raw = getattr(row, "marks", None)
    return read.parse_marks(raw) if raw else None


async def place(reader: read.Reader, job_id: str, n: int, kept: list[read.Mark] | None = None) -> Seen | None:
    """What the stream's first n entries carried, per choice; None when that is no longer known.
    `kept`: the row's marks (`row_marks`), asked before Redis."""
    if n == 0:
        return {}
    marks = kept if kept is not None else await reader.marks(job_id)
    if marks is not None and (n <= max((m[0] for m in marks), default=0)):
        return _from_marks(m for m in marks if m[0] <= n)
    got = await reader.entries_upto(job_id, f"0-{n}")
    if not got or got[-1][0] != f"0-{n}":
        return None
    seen: Seen = {}
    for ev in await decode_all([raw for _, raw in got]):
        if isinstance(ev, Delta):
            _count(seen, ev)
    return seen


def _from_marks(marks: Iterable[read.Mark]) -> Seen:
    seen: Seen = {}
    for _, choice, chars, scores, prefix, finished in marks:
        _add(seen, choice, chars, scores, prefix, finished)
    return seen


def _joins(prev: Delta, ev: Event | Ended) -> bool:
    return (
        isinstance(ev, Delta)
        and prev.choice == ev.choice
        and prev.finish_reason is None
        and ev.prefix_len is None
        and ev.prompt_scores is None
        and (prev.scores is None) == (ev.scores is None)
    )


def _merged(run: list[Delta]) -> Delta:
    """A run of one choice's deltas as one: each part collected, joined once (linear in the run;
    joining two at a time copied the whole run so far at every entry)."""
    if len(run) == 1:
        return run[0]
    first, last = run[0], run[-1]
    return first.model_copy(
        update={
            "text": "".join(d.text for d in run),
            "token_ids": [t for d in run for t in d.token_ids],
            "scores": None if first.scores is None else [s for d in run for s in d.scores or ()],
            "finish_reason": last.finish_reason,
            "eos": last.eos,
            "t": last.t,
        }
    )


def coalesce(group: list[tuple[str | None, Event | Ended]]) -> list[tuple[str | None, Event | Ended]]:
    """Runs of consecutive deltas of one choice as one delta (text, token ids and scores joined),
    under the id of the run's last entry: a reader that fell behind gets one chunk per run instead
    of one per token. Only consecutive entries merge, so every id sent still marks a point before
    which everything was delivered (a Last-Event-ID resume neither skips nor repeats). A delta that
    carries the echoed prompt starts a run of its own."""
    out: list[tuple[str | None, Event | Ended]] = []
    run: list[Delta] = []
    run_id: str | None = None
    for entry_id, ev in group:
        if run and _joins(run[-1], ev):
            run.append(ev)  # type: ignore[arg-type]
            run_id = entry_id if entry_id is not None else run_id
            continue
        if run:
            out.append((run_id, _merged(run)))
            run = []
        if isinstance(ev, Delta):
            run, run_id = [ev], entry_id
        else:
            out.append((entry_id, ev))
    if run:
        out.append((run_id, _merged(run)))
    return out


def _unseen(ev: Event, seen: Seen) -> Event | None:
    """What a reader has not had yet of an event rebuilt from the row."""
    if not isinstance(ev, Delta) or ev.choice not in seen:
        return ev
    chars, scores, prefix, finished = seen[ev.choice]
    text = ev.text[chars:]
    if finished or (not text and not ev.finish_reason):
        return None
    return ev.model_copy(
        update={
            "text": text,
            "scores": ev.scores[scores:] if ev.scores is not None else None,
            "prompt_scores": None if prefix else ev.prompt_scores,
            "prefix_len": None if prefix else ev.prefix_len,
        }
    )
