"""Per-job event streams in Redis: `job:{id}:events`, one JSON payload per entry.

A Redis stream (XADD, never trimmed while the job runs, with a TTL: see `queue_append`) rather
than PUBLISH: a reader that attaches late, or reconnects with `Last-Event-ID` (the stream entry id),
replays exactly what it has not seen. This module only moves payloads; what they mean is
core/generation/events.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from redis.exceptions import ResponseError

from core.infra import redis_keys, transient
from core.infra.backoff import Backoff
from core.infra.kv import Lua

log = logging.getLogger(__name__)

FIELD = "e"


def stream_key(job_id: str) -> str:
    return f"job:{job_id}:events"


def cancel_key(job_id: str) -> str:
    """Set on cancel; the worker running the job polls it (~0.5 s) and drops the job."""
    return f"job:{job_id}:cancel"


def _text(v: Any) -> str:
    return v if isinstance(v, str) else v.decode()


def payload(fields: dict[Any, Any]) -> str:
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    return _text(raw)


def _payload_or_none(fields: dict[Any, Any]) -> str | None:
    """An entry that is not ours (written by hand, say) is skipped, not allowed to stop the shared read."""
    try:
        return payload(fields)
    except (AttributeError, UnicodeDecodeError):
        return None


def marks_key(job_id: str) -> str:
    """Where Spool once kept an ended job's marks in Redis (they are on its row now, `marks_of`):
    read only as a fallback, for a job ended before that; nothing writes it any more."""
    return f"job:{job_id}:marks"


def fence_key(job_id: str) -> str:
    """The newest attempt that claimed the job: older attempts may no longer write its stream."""
    return f"job:{job_id}:fence"


def queue_append(pipe: Any, job_id: str, payloads: Iterable[str], ttl_s: int) -> None:
    """Queue XADDs (and the TTL refresh) on a redis-py pipeline, sync or asyncio alike; the caller
    executes it, so one round trip carries a whole coalesced batch. Streams are never trimmed while
    their job runs: a resume replays the whole stream, and admission bounds a job's size; the TTL,
    refreshed on every append, removes them once the job has been quiet that long. A job's end
    goes through `queue_end`, which shortens it."""
    key = stream_key(job_id)
    for p in payloads:
        pipe.xadd(key, {FIELD: p})
    pipe.expire(key, ttl_s)


# The end of a job that wrote a stream: its terminal event appended (a time-based id, above every
# position), and the stream, which nobody appends to any more, given the short lifetime of an ended
# job's (Postgres answers afterwards). A job that never wrote one (cancelled or expired while queued,
# failed before its first token) gets none now: its readers hear its row at their next silence
# (core/jobs/stream.py), and a 50k-line batch that expires puts nothing into Redis (a one-entry
# stream was ~4.8 KB, Redis preallocating its first listpack). The job's fence goes with the stream
# (a stale attempt that finds the stream gone asks Postgres whether it still owns the job:
# workers/attempt.py). Its marks are not kept here: the ending wrote them on the job's row
# (`marks_of`). What the stream and fence then hold is added to the tenant's count in this window's
# hash (`redis_keys.stored_bytes`), measured by MEMORY USAGE, once per job (no terminal event there yet).
# KEYS: stream, the window's hash, fence; ARGV: ended ttl, tenant, the hash's ttl, the payloads.
_SEAL = r"""
local stream, stored, fence = KEYS[1], KEYS[2], KEYS[3]
redis.call('EXPIRE', fence, ARGV[1])
local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
if #top == 0 then return {} end
local first = string.sub(top[1][1], 1, 2) == '0-'
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = redis.call('XADD', stream, '*', 'e', ARGV[i]) end
redis.call('EXPIRE', stream, ARGV[1])
if first then
  local n = (redis.call('MEMORY', 'USAGE', stream) or 0) + (redis.call('MEMORY', 'USAGE', fence) or 0)
  redis.call('HINCRBY', stored, ARGV[2], n)
  redis.call('EXPIRE', stored, ARGV[3])
end
return ids
"""


_SEAL_SHA = hashlib.sha1(_SEAL.encode()).hexdigest()


def stored_window(ended_ttl_s: int, now: float | None = None) -> int:
    """The window (of `ended_ttl_s` seconds) a job ending at `now` is counted in: what it leaves
    lives at most `ended_ttl_s`, so this window's and the previous one's counts cover all of it."""
    return int(time.time() if now is None else now) // max(1, ended_ttl_s)


def queue_end(pipe: Any, job_id: str, tenant_id: int, payloads: Sequence[str], ended_ttl_s: int) -> None:
    """Queue a job's end (its terminal event) on a redis-py pipeline: appended to its stream if it
    wrote one (nothing at all otherwise), the stream and its fence kept `ended_ttl_s`, their bytes
    counted to the tenant (see `_SEAL`). A NOSCRIPT would only surface at `execute`: the script is
    loaded first in the same pipeline, once however many jobs' ends it carries (a batch's expired
    lines), and then called by its digest."""
    if not getattr(pipe, "_spool_seal_loaded", False):
        pipe.script_load(_SEAL)
        pipe._spool_seal_loaded = True
    stored = redis_keys.stored_bytes(stored_window(ended_ttl_s))
    keys = (stream_key(job_id), stored, fence_key(job_id))
    pipe.evalsha(_SEAL_SHA, 3, *keys, ended_ttl_s, tenant_id, 2 * ended_ttl_s + 60, *payloads)


# Where each delta entry of a job's stream left its choice, read by the job's ending just before its
# statement and kept on the job's row (`jobs.marks`, core/jobs/lifecycle.py): with them an entry id
# still names a place in the row's text once the ended stream has expired, so a resume from it
# neither repeats nor skips (core/jobs/stream.py), for as long as the row exists. One mark per delta:
# `seq,choice,chars,scores,prefix,finish` (its position, its choice, how many characters and scores
# it carried, whether it carried the echoed prompt, a finish_reason), `;`-separated, ~12-16 bytes a
# delta. Computed here, in Redis, so the ending reads a few bytes a delta rather than the stream (most
# of whose bytes are scores). Characters are counted as Python counts them (code points: the UTF-8
# bytes that do not continue a character). An entry that is not a delta (or not ours), or a terminal
# event (a time-based id), has no mark. Read-only. KEYS: stream. Returns '' when there is none.
_MARKS = r"""
local out = {}
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '0-18446744073709551615')) do
  local f, p = e[2], nil
  for i = 1, #f, 2 do if f[i] == 'e' then p = f[i + 1] end end
  p = p or ''
  -- Only the head is decoded (its fields up to the text; the scores after it are most of the
  -- bytes): a quote inside a JSON string is escaped, so these field names match only as fields.
  local cut = string.find(p, ',"token_ids":', 1, true)
  local ok, d = pcall(cjson.decode, cut and (string.sub(p, 1, cut - 1) .. '}') or p)
  if ok and type(d) == 'table' and d.type == 'delta' and type(d.text) == 'string' then
    local _, cont = string.gsub(d.text, '[\128-\191]', '')
    local s = 0
    local at = string.find(p, ',"scores":[', 1, true)
    if at then _, s = string.gsub(string.sub(p, at), '"offset":', '') end
    local pre = string.find(p, ',"prefix_len":', 1, true) and 1 or 0
    local fin = string.find(p, ',"finish_reason":"', 1, true) and 1 or 0
    local seq = string.match(e[1], '^0%-(%d+)$')
    out[#out + 1] = table.concat({seq, tostring(d.choice or 0), #d.text - cont, s, pre, fin}, ',')
  end
end
return table.concat(out, ';')
"""

_MARKS_OF = Lua(_MARKS)


def marks_of(redis: Any, job_id: str) -> str | None:
    """The marks of the job's stream as it stands (sync client; see `_MARKS`), None when it holds no
    delta (or is gone): what its ending keeps on its row. `parse_marks` reads them."""
    raw = _MARKS_OF(redis, [stream_key(job_id)])
    return _text(raw) or None


Mark = tuple[int, int, int, int, bool, bool]  # position, choice, characters, scores, echoed prompt, finish


def parse_marks(raw: Any) -> list[Mark]:
    """The marks `marks_of` read (the job row's, or an older Spool's in Redis), in stream order."""
    out: list[Mark] = []
    for part in _text(raw).split(";"):
        if part:
            seq, choice, chars, scores, pre, fin = part.split(",")
            out.append((int(seq), int(choice), int(chars), int(scores), pre == "1", fin == "1"))
    return out


# Ids that name a place in an answer the job row gave (its stream gone): `<ROW_MS + n>-<k>`, the
# first k events rebuilt from the row after the stream's first n entries (core/jobs/stream.py).
# Above every time-based id Redis makes (ms since 1970) and within Redis's 64 bits: a shared read
# from one returns nothing, ever.
ROW_MS = 10**18


# Append only if no newer attempt has claimed the job (compare-and-append, atomic in Redis): a worker
# that lost its lease but still runs cannot interleave its tokens with its successor's.
# A job's deltas carry positional ids, `0-<n>` for its n-th entry: an append whose answer was lost
# (Redis died after writing it) and is sent again writes nothing twice, and after Redis comes back
# empty the same entries get the same ids again, so a reader's Last-Event-ID still means the same
# place (time-based ids made such a reader receive the same tokens twice). Terminal events get
# time-based ids (`Lifecycle.publish`): above every position, and once one is there nothing more is
# appended (the job ended some other way: a cancel).
#
# One call appends for many jobs, each fenced by its own attempt: a worker's whole decode step is
# one script, so Redis wakes a blocked reader (the API's shared XREAD) once per step with every
# job's token instead of once per job (64 XREADs per step at 64 sequences, most of the API's and
# Redis's CPU per token). KEYS: stream, fence per job; ARGV per job: attempt, ttl, start, n and its
# n payloads. Answers per job: its entries' ids, FENCED or LOST.
_FENCED_APPEND = """
local out = {}
local a = 1
for j = 1, #KEYS, 2 do
  local stream = KEYS[j]
  local attempt, ttl = tonumber(ARGV[a]), ARGV[a + 1]
  local start, n = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local first = a + 4
  a = first + n
  local r = nil
  local fence = tonumber(redis.call('GET', KEYS[j + 1]) or '0')
  local top_seq = 0
  if fence > attempt then
    r = -1
  else
    local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    if #top > 0 then
      local ms, seq = string.match(top[1][1], '^(%d+)-(%d+)$')
      if ms ~= '0' then r = -1 else top_seq = tonumber(seq) end
    elseif start > 1 then
      r = 0
    end
  end
  if r == nil then
    r = {}
    for i = 0, n - 1 do
      local seq = start + i
      if seq > top_seq then redis.call('XADD', stream, '0-' .. seq, 'e', ARGV[first + i]) end
      r[#r + 1] = '0-' .. seq
    end
    redis.call('EXPIRE', stream, ttl)
  end
  out[#out + 1] = r
end
return out
"""

# Raise each job's fence to its attempt (never lower it); returns the fences now in force.
# KEYS: the fence keys; ARGV: the TTL, then one attempt per key.
_RAISE_FENCES = """
local out = {}
for i, key in ipairs(KEYS) do
  local fence = tonumber(redis.call('GET', key) or '0')
  local mine = tonumber(ARGV[i + 1])
  if mine > fence then fence = mine end
  redis.call('SET', key, fence, 'EX', ARGV[1])
  out[i] = fence
end
return out
"""


_FENCE = Lua(_RAISE_FENCES)


class Fenced(Exception):
    """A newer attempt owns the job's stream: this one must stop."""


class StreamLost(Exception):
    """The job's stream is gone although this attempt had written to it (Redis restarted empty):
    nothing was appended; the attempt rebuilds it (if it still owns the job) and appends again."""


# What the fenced append answers for one job besides its ids: a newer attempt owns the job (or it
# has ended), or its stream is lost (an append past entry 1 into no stream at all: found by the
# append itself, so no attempt has to ask Redis whether its stream still exists).
FENCED = -1
LOST = 0
_APPEND = Lua(_FENCED_APPEND)  # by its digest: 64 jobs' appends would otherwise carry 64 copies of its text


def raise_fence(redis: Any, job_id: str, attempt: int, ttl_s: int) -> int:
    """Called by an attempt right after its claim, before it reads what earlier attempts streamed:
    anything a stale attempt appends later is refused, anything before is in what it reads."""
    return raise_fences(redis, [(job_id, attempt)], ttl_s)[0]


def raise_fences(redis: Any, attempts: Sequence[tuple[str, int]], ttl_s: int) -> list[int]:
    """`raise_fence` for several jobs (a claimed group) in one script call; the fences in force."""
    keys = [fence_key(job_id) for job_id, _ in attempts]
    return [int(f) for f in _FENCE(redis, keys, ttl_s, *(attempt for _, attempt in attempts))]


class Append(NamedTuple):
    """One job's entries number `start`, `start + 1`, ... (1-based), by attempt `attempt`."""

    job_id: str
    attempt: int
    payloads: list[str]
    ttl_s: int
    start: int


Appended = list[str] | int | Exception  # the ids, FENCED or LOST; an error of this job's alone


def append_many(redis: Any, appends: Sequence[Append]) -> list[Appended]:
    """Every append in one script call (sync client), each fenced by its own attempt; those entries
    already there (a retried append) are not written again. A connection error is raised for all.
    A script error (a job's key of another type, written by hand) is isolated: each job is appended
    alone, and only the culprit's answer is its error."""
    keys: list[str] = []
    args: list[Any] = []
    for a in appends:
        keys += (stream_key(a.job_id), fence_key(a.job_id))
        args += (a.attempt, a.ttl_s, a.start, len(a.payloads), *a.payloads)
    try:
        raw = _APPEND(redis, keys, *args)
    except ResponseError as exc:
        if isinstance(exc, transient.REDIS):  # Redis refusing writes for now (OOM, MISCONF, READONLY): for all
            raise
        if len(appends) == 1:
            return [exc]
        return [append_many(redis, [a])[0] for a in appends]
    return [r if isinstance(r, int) else [_text(i) for i in r] for r in raw]


def append_fenced(redis: Any, job_id: str, attempt: int, payloads: list[str], ttl_s: int, start: int) -> list[str]:
    """One job's fenced append: its entries' ids, or Fenced / StreamLost / its error raised."""
    return appended(append_many(redis, [Append(job_id, attempt, payloads, ttl_s, start)])[0], job_id, attempt)


def appended(result: Appended, job_id: str, attempt: int) -> list[str]:
    """One job's answer from `append_many`, as its ids or the exception it stands for."""
    if isinstance(result, Exception):
        raise result
    if result == FENCED:
        raise Fenced(f"job {job_id}: attempt {attempt} was superseded")
    if result == LOST:
        raise StreamLost(f"job {job_id}: its event stream is gone")
    assert isinstance(result, list)
    return result


def text(v: Any) -> str:
    return _text(v)


class _Pending:
    __slots__ = ("append", "done", "result")

    def __init__(self, append: Append) -> None:
        self.append = append
        self.done = threading.Event()
        self.result: Appended | BaseException | None = None  # set before `done`


class GroupAppender:
    """Fenced appends of every job of a worker process, written together: each job's thread hands
    its entries here and waits; one thread sends whatever has gathered meanwhile as one fenced-append
    script call. At N live sequences that is one Redis round trip per decode step instead of N EVALs
    from N threads; each append is still fenced by its own attempt (`Fenced` for it alone) and a
    Redis error reaches every caller of that flush as if it had called Redis itself."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.flushes = 0  # round trips made (tests and the bench read it)

    def append(self, job_id: str, attempt: int, payloads: list[str], ttl_s: int, start: int) -> list[str]:
        item = _Pending(Append(job_id, attempt, payloads, ttl_s, start))
        with self._lock:  # started on first use: processes that never stream hold no thread
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-appender", daemon=True)
                self._thread.start()
        self._queue.put(item)
        item.done.wait()
        if isinstance(item.result, BaseException):
            raise item.result
        assert item.result is not None
        return appended(item.result, job_id, attempt)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # everything handed in while the previous flush was on the wire
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            results: Sequence[Appended | BaseException]
            try:
                results = append_many(self._redis, [item.append for item in batch])
            except Exception as e:  # the connection: every caller of this flush sees it
                results = [e] * len(batch)
            self.flushes += 1
            for item, r in zip(batch, results, strict=True):
                item.result = r
                item.done.set()


def trimmed(redis: Any, job_id: str) -> bool:
    """Whether entries were ever removed from the stream (by hand, or by an older Spool's cap): a
    resume from it would be wrong. A missing stream is not trimmed (nothing to trust or distrust)."""
    try:
        info = redis.xinfo_stream(stream_key(job_id))
    except Exception:
        return False
    added = info.get("entries-added", info.get(b"entries-added"))
    return added is not None and int(added) != int(info.get("length", info.get(b"length", 0)))


def rebuild(redis: Any, job_id: str, logged: list[tuple[str, str]], ttl_s: int) -> None:
    """Write a lost stream again with its original entry ids, so a reader's Last-Event-ID still
    points into it and nothing is delivered twice."""
    key = stream_key(job_id)
    pipe = redis.pipeline(transaction=True)
    pipe.delete(key)
    for entry_id, p in logged:
        pipe.xadd(key, {FIELD: p}, id=entry_id)
    pipe.expire(key, ttl_s)
    pipe.execute()


def entries(redis: Any, job_id: str) -> list[tuple[str, str]]:
    """Every entry still in the stream (sync client): (entry id, payload)."""
    return [(_text(i), payload(f)) for i, f in redis.xrange(stream_key(job_id))]


class Reader(Protocol):
    """What follows a job's stream (a `Hub`): entries after `last_id`, forever; None whenever
    `block_ms` passes in silence."""

    def read(self, job_id: str, last_id: str, block_ms: int) -> AsyncIterator[tuple[str, str] | None]: ...

    def read_batches(
        self, job_id: str, last_id: str, block_ms: int
    ) -> AsyncGenerator[list[tuple[str, str]] | None, None]:
        """The same entries, as lists of everything that had arrived when the caller asked again: a
        caller that fell behind (a slow client) gets the backlog at once."""
        ...

    async def marks(self, job_id: str) -> list[Mark] | None:
        """The marks an older Spool kept in Redis for an ended job (`marks_key`), None when there are
        none: the job's row holds them now (`marks_of`), and is asked first."""
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
        async with contextlib.aclosing(self.read_batches(job_id, last_id, block_ms)) as batches:
            async for batch in batches:  # closed with this generator: the follower leaves at once
                if batch is None:
                    yield None
                    continue
                for item in batch:
                    yield item

    async def read_batches(
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
                batch = list(entries)
                while not f.inbox.empty():  # whatever else arrived while the caller was busy
                    more = f.inbox.get_nowait()
                    if more is None:
                        continue  # news came after all: not silent
                    if isinstance(more, Exception):
                        if batch:
                            yield batch
                        raise more
                    batch += more
                yield batch
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
        return [(_text(i), p) for i, f in got if (p := _payload_or_none(f)) is not None]

    async def page(self, job_id: str, after: str, count: int) -> list[tuple[str, str]]:
        if parse_id(after) is None:
            raise InvalidStreamId(f"invalid stream entry id {after!r}")
        got = await self.redis.xrange(stream_key(job_id), f"({after}", "+", count=count)
        return [(_text(i), p) for i, f in got if (p := _payload_or_none(f)) is not None]

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
            key = _text(raw_key)
            if key == self._wake_key:
                self._wake_last = _text(raw_entries[-1][0])
                continue
            entries = [(_text(i), p) for i, fields in raw_entries if (p := _payload_or_none(fields)) is not None]
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
