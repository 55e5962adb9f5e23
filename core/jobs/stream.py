"""Following a job's event stream (Redis) until its end, answered by Postgres when it is gone."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from core.generation.events import Delta, Event, TerminalRow, decode, from_row, is_terminal
from core.infra import streams

RowCheck = Callable[[], Awaitable[TerminalRow | None]]
HEARTBEAT = object()


async def follow(
    reader: streams.Reader, job_id: str, check_row: RowCheck, last_id: str = "0-0", block_ms: int = 2000
) -> AsyncIterator[tuple[str | None, Event] | object]:
    """Yield (entry id, event) from `last_id` on until a terminal event. When the stream is silent,
    yield HEARTBEAT and consult Postgres, which answers if the stream expired or was never written
    (a job that failed before its worker started, say)."""
    async with contextlib.aclosing(follow_batches(reader, job_id, check_row, last_id, block_ms)) as batches:
        async for batch in batches:
            if batch is HEARTBEAT:
                yield HEARTBEAT
                continue
            for item in batch:  # type: ignore[union-attr]
                yield item


async def follow_batches(
    reader: streams.Reader, job_id: str, check_row: RowCheck, last_id: str = "0-0", block_ms: int = 2000
) -> AsyncGenerator[list[tuple[str | None, Event]] | object, None]:
    """`follow`, as lists of what had arrived when asked (more than one event: the caller is behind)."""
    seen: dict[int, tuple[int, int, bool]] = {}  # per choice: text chars, scores, prompt part delivered
    async with contextlib.aclosing(reader.read_batches(job_id, last_id, block_ms)) as reading:
        async for entries in reading:
            if entries is None:
                row = await check_row()
                if row is not None:
                    rest = [(None, r) for r in (_unseen(ev, seen) for ev in from_row(row)) if r is not None]
                    if rest:
                        yield rest
                    return
                yield HEARTBEAT
                continue
            out: list[tuple[str | None, Event]] = []
            for entry_id, raw in entries:
                ev = decode(raw)
                if isinstance(ev, Delta):
                    chars, scores, prefix = seen.get(ev.choice, (0, 0, False))
                    seen[ev.choice] = (
                        chars + len(ev.text),
                        scores + len(ev.scores or []),
                        prefix or ev.prefix_len is not None,
                    )
                out.append((entry_id, ev))
                if is_terminal(ev):
                    yield out
                    return
            yield out


def coalesce(batch: list[tuple[str | None, Event]]) -> list[tuple[str | None, Event]]:
    """Runs of consecutive deltas of one choice as one delta (text, token ids and scores joined),
    under the id of the run's last entry: a reader that fell behind gets one chunk per run instead
    of one per token. Only consecutive entries merge, so every id sent still marks a point before
    which everything was delivered (a Last-Event-ID resume neither skips nor repeats). A delta that
    carries the echoed prompt starts a run of its own."""
    out: list[tuple[str | None, Event]] = []
    for entry_id, ev in batch:
        prev = out[-1][1] if out else None
        if (
            isinstance(ev, Delta)
            and isinstance(prev, Delta)
            and prev.choice == ev.choice
            and prev.finish_reason is None
            and ev.prefix_len is None
            and ev.prompt_scores is None
            and (prev.scores is None) == (ev.scores is None)
        ):
            merged = prev.model_copy(
                update={
                    "text": prev.text + ev.text,
                    "token_ids": prev.token_ids + ev.token_ids,
                    "scores": None if prev.scores is None else [*prev.scores, *(ev.scores or [])],
                    "finish_reason": ev.finish_reason,
                    "eos": ev.eos,
                    "t": ev.t,
                }
            )
            out[-1] = (entry_id if entry_id is not None else out[-1][0], merged)
        else:
            out.append((entry_id, ev))
    return out


def _unseen(ev: Event, seen: dict[int, tuple[int, int, bool]]) -> Event | None:
    """What a reader has not had yet of an event rebuilt from the row (its stream was lost midway)."""
    if not isinstance(ev, Delta) or ev.choice not in seen:
        return ev
    chars, scores, prefix = seen[ev.choice]
    text = ev.text[chars:]
    if not text and not ev.finish_reason:
        return None
    return ev.model_copy(
        update={
            "text": text,
            "scores": ev.scores[scores:] if ev.scores is not None else None,
            "prompt_scores": None if prefix else ev.prompt_scores,
            "prefix_len": None if prefix else ev.prefix_len,
        }
    )
