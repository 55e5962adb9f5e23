"""The write side of the per-job event streams, what a worker (and a job's ending) uses: fenced
appends, grouped per decode step; fences; a job's end sealed into its stream; the marks its ending
keeps on the row; a lost stream rebuilt.

A Redis stream (XADD, never trimmed while the job runs, with a TTL: see `queue_append`) rather
than PUBLISH: a reader that attaches late, or reconnects with `Last-Event-ID` (the stream entry id),
replays exactly what it has not seen (read.py). This module only moves payloads; what they mean is
core/generation/events.py.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from core.infra import redis_keys, transient
from core.infra.kv import Lua
from core.infra.streams.keys import FIELD, fence_key, payload, stream_key, text


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
# (core/jobs/follow.py), and a 50k-line batch that expires puts nothing into Redis (a one-entry
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
# neither repeats nor skips (core/jobs/follow.py), for as long as the row exists. One mark per delta:
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
    delta (or is gone): what its ending keeps on its row. `read.parse_marks` reads them."""
    raw = _MARKS_OF(redis, [stream_key(job_id)])
    return text(raw) or None


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
    return [r if isinstance(r, int) else [text(i) for i in r] for r in raw]


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
    return [(text(i), payload(f)) for i, f in redis.xrange(stream_key(job_id))]
