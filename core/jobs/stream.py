"""Following a job's event stream (Redis) until its end, answered by Postgres when it is gone."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

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
    seen: dict[int, tuple[int, int, bool]] = {}  # per choice: text chars, scores, prompt part delivered
    async for item in reader.read(job_id, last_id, block_ms):
        if item is None:
            row = await check_row()
            if row is not None:
                for ev in from_row(row):
                    rest = _unseen(ev, seen)
                    if rest is not None:
                        yield None, rest
                return
            yield HEARTBEAT
            continue
        entry_id, raw = item
        ev = decode(raw)
        if isinstance(ev, Delta):
            chars, scores, prefix = seen.get(ev.choice, (0, 0, False))
            seen[ev.choice] = (chars + len(ev.text), scores + len(ev.scores or []), prefix or ev.prefix_len is not None)
        yield entry_id, ev
        if is_terminal(ev):
            return


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
