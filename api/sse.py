"""SSE framing of a job's chunks: the protocol renders chunk objects, this module frames them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import anyio
import redis.asyncio as aioredis
from fastapi.sse import format_sse_event

from api.cache import SingleFlight
from core.generation.events import TerminalRow
from core.infra import redis_keys
from core.infra.streams import read
from core.infra.transient import DATABASE
from core.jobs import transitions
from core.jobs.follow import HEARTBEAT, Ended, coalesce, follow_grouped
from core.protocol.render import DONE, CompletionChunks, JobRecord, chunks_for


def sse(data: dict[str, Any] | str, event_id: str | None = None) -> bytes:
    raw = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return format_sse_event(data_str=raw, id=event_id)


def sse_comment(text: str) -> bytes:
    """A comment line alone, with no blank line after it. The blank line that ends an event block
    makes some decoders dispatch an event even when the block held only a comment: the openai SDK's
    keeps the last `id:` across events, emits an event with empty data and fails to parse it as JSON.
    A comment line is all a proxy needs to keep the connection open (WHATWG SSE: lines starting with
    ':' are ignored, and the next event's fields simply follow it)."""
    return b": " + text.encode() + b"\n"


_TERMINAL: SingleFlight[TerminalRow | None] = SingleFlight(ttl_s=1.0)


# Reads a tenant's job row: `get` of core/jobs/service.Completions, on the sessions the app gave it.
RowLookup = Callable[[str, int], Awaitable[TerminalRow | None]]


def terminal_row_check(job_id: str, tenant_id: int, lookup: RowLookup):
    """Asked when the stream is silent: the job's row if it has ended (its stream may be gone)."""

    async def load() -> TerminalRow | None:
        row = await lookup(job_id, tenant_id)
        return row if row is not None and transitions.is_terminal(row.state) else None

    async def check() -> TerminalRow | None:
        try:  # every reader of a job that falls silent at once shares one query
            return await _TERMINAL.get((job_id, tenant_id), load)
        except DATABASE:
            return None  # Postgres is restarting or busy: the stream goes on; we ask again at the next silence

    return check


# Readers of a job: a sorted set of one member per following stream, scored by when its lease ends
# (renewed while it follows; a replica that died leaves a member that lapses, never a count that
# stays up). A counter with a TTL went to -1 when its TTL lapsed under a long stream and the stream
# then ended: every later disconnect found "readers" and nothing was ever cancelled again.
READER_LEASE_S = 600
READER_RENEW_S = 120


async def readers(rds: aioredis.Redis, job_id: str) -> int:
    """How many SSE streams follow this job right now (on any API replica)."""
    return int(await rds.zcount(redis_keys.readers(job_id), time.time(), "+inf"))


# A group worth more than this (entries, plus scores: logprobs are most of a replay's bytes) is
# coalesced, rendered and framed on a worker thread: a replay's backlog of 16k deltas with logprobs,
# or a choice rebuilt from the row with 200k of them, would hold the loop for seconds.
OFF_LOOP_WEIGHT = 512


class TenantGate:
    """At most `cap` of one tenant's heavy builds at once on this process (a replay's backlog framed
    on a thread, a large job object encoded): the tenant's others wait their turn, and no other
    tenant ever waits on them. Followers of a live stream hold nothing (1,000 readers of one job cost
    no place); only the catch-up work that scales with what a client asks for does.

    One semaphore per tenant that has built something heavy, per event loop (bounded by the tenants)."""

    def __init__(self) -> None:
        self._sems: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary()
        )
        self.busy: dict[int, int] = {}
        self.most: dict[int, int] = {}  # the most of a tenant's builds at once (tests, metrics)

    @contextlib.asynccontextmanager
    async def hold(self, tenant_id: int, cap: int) -> AsyncIterator[None]:
        sems = self._sems.setdefault(asyncio.get_running_loop(), {})
        sem = sems.get(tenant_id)
        if sem is None:
            sem = sems[tenant_id] = asyncio.Semaphore(cap)
        async with sem:
            self.busy[tenant_id] = now = self.busy.get(tenant_id, 0) + 1
            self.most[tenant_id] = max(self.most.get(tenant_id, 0), now)
            try:
                yield
            finally:
                self.busy[tenant_id] -= 1


HEAVY = TenantGate()


def _weight(group: list) -> int:
    return sum(1 + len(getattr(ev, "scores", None) or ()) + len(getattr(ev, "text", "")) // 256 for _, ev in group)


def frame(chunks: CompletionChunks, group: list) -> bytes:
    """A group of (id, event) as SSE bytes: each run of one choice's tokens as one chunk."""
    out = bytearray()
    for entry_id, ev in coalesce(group):
        if isinstance(ev, Ended):
            out += sse(DONE)
            continue
        for chunk in chunks.render(ev):
            out += sse(chunk, entry_id if isinstance(chunk, dict) else None)
    return bytes(out)


async def sse_chunks(
    job: JobRecord,
    tenant_id: int,
    rds: aioredis.Redis,
    reader: read.Reader,
    *,
    lookup: RowLookup,
    include_usage: bool,
    fingerprint: str,
    heavy_cap: int,
    last_id: str = "0-0",
) -> AsyncIterator[bytes]:
    """A job's events as OpenAI completion chunks (SSE bytes), with keep-alive comments while the
    stream is silent; ends after the terminal event. A heavy group (a replay's backlog) is decoded and
    framed on threads, at most `heavy_cap` of the tenant's at once (`HEAVY`, held from its decoding
    until it has been sent). `lookup` reads the job's row when the stream falls silent."""
    chunks = chunks_for(job, include_usage, fingerprint)
    check = terminal_row_check(job.id, tenant_id, lookup)
    gate = functools.partial(HEAVY.hold, tenant_id, heavy_cap)
    ended = transitions.is_terminal(job.state)  # an ended job with no stream left is answered by its row at once
    async with (
        ReaderLease(rds, job.id, live=not ended) as lease,
        contextlib.aclosing(follow_grouped(reader, job.id, check, last_id=last_id, heavy=gate, ended=ended)) as groups,
    ):
        async for group in groups:
            await lease.renew()
            if group is HEARTBEAT:
                yield sse_comment("keep-alive")
                continue
            # Everything that arrived while this client was being written to goes out in one
            # write, each run of one choice's tokens as one chunk (core/jobs/follow.coalesce).
            items = cast(list, group)
            del group  # neither the events nor their bytes are held while waiting for the next group
            if _weight(items) > OFF_LOOP_WEIGHT:  # a heavy group: follow_grouped holds its gate place
                out = await anyio.to_thread.run_sync(frame, chunks, items)
            else:
                out = frame(chunks, items)
            del items
            if out:
                yield out
            del out


class ReaderLease:
    """This stream, counted among its job's readers while it follows the job (a disconnected stream's
    job is cancelled only when nobody follows it), its lease renewed as it goes.

    The count goes up and back down in tasks of their own: a stream cancelled at any moment, even
    while its increment is in flight, still takes back exactly what it added, so a client that hangs
    up at once leaves no phantom reader behind. A job that had already ended when the stream began
    (`live=False`) has nothing to cancel and is not counted: 200 replays of one cost 400 Redis round
    trips at intake, on the loop every other stream shares."""

    def __init__(self, rds: aioredis.Redis, job_id: str, *, live: bool = True) -> None:
        self._rds, self._job_id, self._live = rds, job_id, live
        self._member = uuid.uuid4().hex
        self._counted: asyncio.Future[bool] | None = None
        self._renewed = time.monotonic()

    async def __aenter__(self) -> ReaderLease:
        if self._live:
            self._counted = asyncio.ensure_future(_count_reader(self._rds, self._job_id, self._member))
            try:
                await asyncio.shield(self._counted)
            except BaseException:  # cancelled while counting: no __aexit__ follows, take it back here
                self._uncount()
                raise
        return self

    async def renew(self) -> None:
        if self._counted is None or time.monotonic() - self._renewed < READER_RENEW_S or not self._counted.result():
            return
        self._renewed = time.monotonic()
        await _count_reader(self._rds, self._job_id, self._member)

    async def __aexit__(self, *exc: object) -> None:
        self._uncount()

    def _uncount(self) -> None:
        if self._counted is not None:
            task = asyncio.get_running_loop().create_task(
                _uncount_reader(self._rds, self._job_id, self._member, self._counted)
            )
            _UNCOUNTING.add(task)
            task.add_done_callback(_UNCOUNTING.discard)
            self._counted = None


_UNCOUNTING: set[asyncio.Task] = set()


async def _count_reader(rds: aioredis.Redis, job_id: str, member: str) -> bool:
    """This reader's member, leased for READER_LEASE_S from now (added, or renewed)."""
    key, now = redis_keys.readers(job_id), time.time()
    try:
        pipe = rds.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", now)  # lapsed leases (a replica that died)
        pipe.zadd(key, {member: now + READER_LEASE_S})
        pipe.expire(key, READER_LEASE_S)
        await pipe.execute()
        return True
    except Exception:  # counting readers is best effort: a Redis outage must not end the stream
        return False


async def _uncount_reader(rds: aioredis.Redis, job_id: str, member: str, counted: asyncio.Future[bool]) -> None:
    with contextlib.suppress(Exception):
        if await counted:
            await rds.zrem(redis_keys.readers(job_id), member)
