"""The read side of the per-job event streams, what the API uses: the `Hub` that follows every
stream of the process with one blocking XREAD, replay pages and ranges, resume ids checked before
they reach Redis, and the marks an older Spool kept in Redis.

A reader that attaches late, or reconnects with `Last-Event-ID` (the stream entry id), replays
exactly what it has not seen; the write side (write.py) numbers the entries. What the entries mean is
core/generation/events.py; following one job to its end is core/jobs/follow.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

from core.infra import transient
from core.infra.backoff import Backoff
from core.infra.streams.keys import marks_key, payload, stream_key, text

log = logging.getLogger(__name__)


def _payload_or_none(fields: dict[Any, Any]) -> str | None:
    """An entry that is not ours (written by hand, say) is skipped, not allowed to stop the shared read."""
    try:
        return payload(fields)
    except (AttributeError, UnicodeDecodeError):
        return None


Mark = tuple[int, int, int, int, bool, bool]  # position, choice, characters, scores, echoed prompt, finish


def parse_marks(raw: Any) -> list[Mark]:
    """The marks `write.marks_of` read (the job row's, or an older Spool's in Redis), in stream order."""
    out: list[Mark] = []
    for part in text(raw).split(";"):
        if part:
            seq, choice, chars, scores, pre, fin = part.split(",")
            out.append((int(seq), int(choice), int(chars), int(scores), pre == "1", fin == "1"))
    return out


# Ids that name a place in an answer the job row gave (its stream gone): `<ROW_MS + n>-<k>`, the
# first k events rebuilt from the row after the stream's first n entries (core/jobs/follow.py).
# Above every time-based id Redis makes (ms since 1970) and within Redis's 64 bits: a shared read
# from one returns nothing, ever.
ROW_MS = 10**18


class Reader(Protocol):
    """What follows a job's stream (a `Hub`): entries after `last_id`, forever; None whenever
    `block_ms` passes in silence."""

    def read(self, job_id: str, last_id: str, block_ms: int) -> AsyncIterator[tuple[str, str] | None]: ...

    def read_grouped(
        self, job_id: str, last_id: str, block_ms: int
    ) -> AsyncGenerator[list[tuple[str, str]] | None, None]:
        """The same entries, as lists of everything that had arrived when the caller asked again: a
        caller that fell behind (a slow client) gets the backlog at once."""
        ...

    async def marks(self, job_id: str) -> list[Mark] | None:
        """The marks an older Spool kept in Redis for an ended job (`marks_key`), None when there are
        none: the job's row holds them now (`write.marks_of`), and is asked first."""
        ...

    async def entries_upto(self, job_id: str, last_id: str) -> list[tuple[str, str]]:
        """The stream's entries up to `last_id` included, as far as it still holds them."""
        ...

    async def page(self, job_id: str, after: str, count: int) -> list[tuple[str, str]]:
        """Up to `count` of the stream's entries after `after` (a backlog read by one follower alone)."""
        ...

    async def exists(self, job_id: str) -> bool:
        """Whether the job's stream is there (a Redis outage counts as there: the stream is followed)."""
        ...


# A stream entry id as Redis reads it: ASCII digits only (str.isdigit also takes "²" and
# Arabic-Indic digits), each part within 64 bits. Anything else makes XREAD fail for every stream
# named in the same call.
_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
_U64 = 2**64 - 1


class InvalidStreamId(ValueError):
    """A client-supplied resume id that Redis would refuse."""


def parse_id(value: str) -> str | None:
    """The canonical `ms-seq` form of a client-supplied entry id, or None when Redis would refuse it."""
    m = _ID.fullmatch(value)
    if m is None:
        return None
    ms, seq = int(m[1]), int(m[2] or 0)
    return f"{ms}-{seq}" if ms <= _U64 and seq <= _U64 else None


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class _Follower:
    __slots__ = ("delivered", "fed_at", "inbox", "key", "timer")

    def __init__(self, key: str, last_id: str, now: float) -> None:
        self.key, self.delivered = key, last_id
        # None in the inbox: `block_ms` passed with nothing for this follower (see Hub._silence).
        self.inbox: asyncio.Queue[list[tuple[str, str]] | Exception | None] = asyncio.Queue()
        self.fed_at = now  # loop time of the last thing put in the inbox
        self.timer: asyncio.TimerHandle | None = None


class Hub:
    """Every stream one API process follows, read by one blocking XREAD over all of them (asyncio).

    One stream per blocking XREAD cost a Redis connection per open stream and a round trip per
    stream per event: about 40 % of the API's CPU per streamed token. Here one call returns the news
    of every stream at once. A follower joins with the entry id it has seen; when the shared read is
    already blocked, the follower wakes it (an XADD to this process's own wake stream, read from the
    last wake it saw, so a wake is never missed) and the next read includes the new stream. Readers
    of one job at different positions share the read from the earliest of them.
    """

    def __init__(self, redis: Any, block_ms: int = 5000, wake_ttl_s: int = 3600) -> None:
        self.redis, self.block_ms, self.wake_ttl_s = redis, block_ms, wake_ttl_s
        self._followers: dict[str, set[_Follower]] = {}
        self._wake_key = f"spool:hub:{uuid.uuid4().hex}"
        self._wake_last = "0-0"
        self._blocked = False
        self._woken = False  # a wake was sent during the read now blocked: later joiners need none
        self._news = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False

    async def read(self, job_id: str, last_id: str, block_ms: int) -> AsyncIterator[tuple[str, str] | None]:
        """(entry id, payload) after `last_id`, forever; None whenever `block_ms` passes in silence
        (Redis away included: the caller consults Postgres meanwhile). An id Redis would refuse
        raises InvalidStreamId here, before it can reach the shared read."""
        async with contextlib.aclosing(self.read_grouped(job_id, last_id, block_ms)) as groups:
            async for group in groups:  # closed with this generator: the follower leaves at once
                if group is None:
                    yield None
                    continue
                for item in group:
                    yield item

    async def read_grouped(
        self, job_id: str, last_id: str, block_ms: int
    ) -> AsyncGenerator[list[tuple[str, str]] | None, None]:
        start = parse_id(last_id)
        if start is None:
            raise InvalidStreamId(f"invalid stream entry id {last_id!r}")
        loop = asyncio.get_running_loop()
        f = _Follower(stream_key(job_id), start, loop.time())
        self._followers.setdefault(f.key, set()).add(f)
        self._news.set()
        # Silence is told by one timer per follower, re-armed when it fires, not by a timeout around
        # every wait: that was a timer scheduled and cancelled per token (~6 % of the API's CPU per
        # streamed token at 64 streams).
        f.timer = loop.call_later(block_ms / 1000, self._silence, f, block_ms / 1000)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        elif self._blocked and not self._woken:
            self._woken = True  # set before the await: followers joining meanwhile share this wake
            await self._wake()
        try:
            while True:
                entries = await f.inbox.get()
                if entries is None:
                    f.fed_at = loop.time()  # the next None a whole `block_ms` after this one is taken
                    yield None
                    continue
                if isinstance(entries, Exception):
                    raise entries
                group = list(entries)
                while not f.inbox.empty():  # whatever else arrived while the caller was busy
                    more = f.inbox.get_nowait()
                    if more is None:
                        continue  # news came after all: not silent
                    if isinstance(more, Exception):
                        if group:
                            yield group
                        raise more
                    group += more
                yield group
        finally:
            if f.timer is not None:
                f.timer.cancel()
            peers = self._followers.get(f.key)
            if peers is not None:
                peers.discard(f)
                if not peers:
                    del self._followers[f.key]

    def _silence(self, f: _Follower, every: float) -> None:
        """Timer: `every` seconds with nothing put for `f` (and nothing unread) puts a None; re-armed
        for `every` after the last thing put, so a silent follower hears None every `every` seconds."""
        loop = asyncio.get_running_loop()
        idle = loop.time() - f.fed_at
        if idle >= every:
            if f.inbox.empty():
                f.inbox.put_nowait(None)
            f.fed_at, idle = loop.time(), 0.0
        f.timer = loop.call_later(every - idle, self._silence, f, every)

    async def marks(self, job_id: str) -> list[Mark] | None:
        raw = await self.redis.get(marks_key(job_id))
        return None if raw is None else parse_marks(raw)

    async def exists(self, job_id: str) -> bool:
        try:
            return bool(await self.redis.exists(stream_key(job_id)))
        except transient.REDIS:
            return True

    async def entries_upto(self, job_id: str, last_id: str) -> list[tuple[str, str]]:
        got = await self.redis.xrange(stream_key(job_id), "-", last_id)
        return [(text(i), p) for i, f in got if (p := _payload_or_none(f)) is not None]

    async def page(self, job_id: str, after: str, count: int) -> list[tuple[str, str]]:
        if parse_id(after) is None:
            raise InvalidStreamId(f"invalid stream entry id {after!r}")
        got = await self.redis.xrange(stream_key(job_id), f"({after}", "+", count=count)
        return [(text(i), p) for i, f in got if (p := _payload_or_none(f)) is not None]

    async def _wake(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self._wake_key, {"w": 1}, maxlen=10, approximate=True)
            pipe.expire(self._wake_key, self.wake_ttl_s)
            await pipe.execute()
        except transient.REDIS:
            pass  # Redis away: the shared read fails too, and includes this stream when it retries

    async def _run(self) -> None:
        backoff = Backoff()  # no deadline: the hub waits Redis out however long it is away
        # A cancel that lands inside redis-py's blocked read can come back as a connection error
        # (and be lost): the flag ends the loop anyway, after that read.
        while not self._closed:
            if not self._followers:
                self._news.clear()
                await self._news.wait()
            try:
                await self._read_once()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away or restarting: followers hear silence meanwhile
                if not isinstance(exc, transient.REDIS):
                    if await self._evict_culprits():
                        continue  # the streams Redis refused are gone; the others read again at once
                    log.exception("stream hub read failed; retrying")
                await asyncio.sleep(backoff.step())

    async def _read_once(self) -> None:
        # Each stream from the earliest position any of its followers has been given.
        wanted = {k: min((f.delivered for f in fs), key=_order) for k, fs in self._followers.items()}
        wanted[self._wake_key] = self._wake_last
        self._blocked = True
        try:
            resp = await self.redis.xread(wanted, block=self.block_ms, count=1000)
        finally:
            self._blocked = self._woken = False
        now = asyncio.get_running_loop().time()
        for raw_key, raw_entries in resp or []:
            key = text(raw_key)
            if key == self._wake_key:
                self._wake_last = text(raw_entries[-1][0])
                continue
            entries = [(text(i), p) for i, fields in raw_entries if (p := _payload_or_none(fields)) is not None]
            began = _order(wanted[key]) if key in wanted else None
            for f in self._followers.get(key, ()):
                after = _order(f.delivered)
                if began is None or after < began:
                    # Joined while this read was in flight, from before where it began: these entries
                    # would skip what lies between. The next read starts from this follower's place.
                    continue
                mine = [e for e in entries if _order(e[0]) > after]
                if mine:
                    f.delivered, f.fed_at = mine[-1][0], now
                    f.inbox.put_nowait(mine)

    async def _evict_culprits(self) -> bool:
        """After a refused shared read, find the streams Redis refuses alone (a key of another type,
        say) and fail their followers only; True when any was found."""
        found = False
        for key, fs in list(self._followers.items()):
            start = min((f.delivered for f in fs), key=_order)
            try:
                await self.redis.xread({key: start}, count=1)
            except transient.REDIS:
                return found
            except Exception as exc:
                log.warning("stream hub: %s refused (%s); failing its followers alone", key, exc)
                for f in fs:
                    f.inbox.put_nowait(exc)
                del self._followers[key]
                found = True
        return found

    async def aclose(self) -> None:
        self._closed = True
        if self._task is not None:
            # redis-py can lose a cancel that lands in a blocked XREAD, which then waits out its whole
            # block (30 s, twice): a wake returns the read at once, and the loop sees the flag.
            if self._blocked:
                await self._wake()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
