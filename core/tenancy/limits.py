"""Per-tenant (and per-key) limits, enforced atomically in Redis so any number of API replicas
share them.

Why hand-written Lua: `slowapi` is synchronous and the `limits` package cannot refund, while tokens
per minute must be reserved at admission (prompt + max_tokens) and settled to the real usage when the
job ends. One script (`ADMIT`) checks every limit and commits all of them or none; one (`REQUESTS`) takes
the requests/minute alone, before a body is read (api/request_gate.py); another (`SETTLE`) settles a
job's reservation exactly once (the reservation record is deleted as it is settled).

- requests/minute: GCRA (burst = the limit), per tenant and optionally per key
- tokens/minute: a token bucket that refills continuously and takes refunds
- tokens/day: a counter per UTC day
- queued jobs: a leased set of the tenant's live jobs (members expire if a settle is ever lost)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from core.infra import redis_keys
from core.infra.kv import Lua

ADMIT = r"""
-- KEYS: 1 rpm_tenant 2 tpm_tenant 3 tpd_tenant 4 active_tenant 5 rpm_key 6 tpm_key 7 reservation
-- ARGV: 1 now_ms 2 rpm_t 3 tpm_t 4 tpd_t 5 max_queued 6 rpm_k 7 tpm_k 8 cost 9 job_id 10 lease_ms 11 day_ttl_ms
local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[8])
-- A job admitted before (a batch line the reaper sent back to the queue) takes nothing twice.
if redis.call('EXISTS', KEYS[7]) == 1 then return {1, '', '0', -1, -1, '0', -1, -1, '0'} end

local function gcra(key, limit)
  if limit <= 0 then return {1, -1, -1, 0, 0} end
  local period = 60000
  local emission = period / limit
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + emission
  local allow_at = new_tat - period
  if now < allow_at then
    return {0, limit, 0, tat - now, allow_at - now}
  end
  return {1, limit, math.floor((now - allow_at) / emission), new_tat - now, 0, new_tat}
end

local function bucket(key, cap)
  if cap <= 0 then return {1, -1, -1, 0, 0} end
  local rate = cap / 60000
  local tokens = tonumber(redis.call('HGET', key, 't') or cap)
  local ts = tonumber(redis.call('HGET', key, 's') or now)
  tokens = math.min(cap, tokens + (now - ts) * rate)
  if cost > tokens then
    local wait = (cost - tokens) / rate
    if cost > cap then wait = -1 end
    return {0, cap, math.floor(tokens), math.ceil((cap - tokens) / rate), wait}
  end
  return {1, cap, math.floor(tokens - cost), math.ceil((cap - tokens + cost) / rate), 0, tokens - cost}
end

local r1 = gcra(KEYS[1], tonumber(ARGV[2]))
local r2 = gcra(KEYS[5], tonumber(ARGV[6]))
local t1 = bucket(KEYS[2], tonumber(ARGV[3]))
local t2 = bucket(KEYS[6], tonumber(ARGV[7]))
local tpd = tonumber(ARGV[4])
local used = tonumber(redis.call('GET', KEYS[3]) or 0)
local maxq = tonumber(ARGV[5])
if maxq > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now) end
local queued = (maxq > 0) and redis.call('ZCARD', KEYS[4]) or 0

-- the headers report the tightest of tenant and key
local req = r1
if r2[2] >= 0 and (req[2] < 0 or r2[3] < req[3]) then req = r2 end
local tok = t1
if t2[2] >= 0 and (tok[2] < 0 or t2[3] < tok[3]) then tok = t2 end

local refused = ''
local wait = 0
if r1[1] == 0 then refused = 'requests'; wait = r1[5]
elseif r2[1] == 0 then refused = 'requests'; wait = r2[5]
elseif t1[1] == 0 then refused = 'tokens'; wait = t1[5]
elseif t2[1] == 0 then refused = 'tokens'; wait = t2[5]
elseif tpd > 0 and used + cost > tpd then refused = 'tokens_per_day'; wait = -2
elseif maxq > 0 and queued >= maxq then refused = 'queued_jobs'; wait = 1000
end
if refused ~= '' then
  return {0, refused, tostring(wait), req[2], req[3], tostring(req[4]), tok[2], tok[3], tostring(tok[4])}
end

-- commit every limit
if r1[6] then redis.call('SET', KEYS[1], r1[6], 'PX', math.ceil(r1[6] - now) + 1) end
if r2[6] then redis.call('SET', KEYS[5], r2[6], 'PX', math.ceil(r2[6] - now) + 1) end
if t1[6] then redis.call('HSET', KEYS[2], 't', t1[6], 's', now); redis.call('PEXPIRE', KEYS[2], 120000) end
if t2[6] then redis.call('HSET', KEYS[6], 't', t2[6], 's', now); redis.call('PEXPIRE', KEYS[6], 120000) end
if tpd > 0 then redis.call('INCRBY', KEYS[3], cost); redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[11])) end
if maxq > 0 then redis.call('ZADD', KEYS[4], now + tonumber(ARGV[10]), ARGV[9]) end
redis.call('HSET', KEYS[7], 'cost', cost, 'tpm_t', (tonumber(ARGV[3]) > 0) and KEYS[2] or '',
  'tpm_k', (tonumber(ARGV[7]) > 0) and KEYS[6] or '', 'tpd', (tpd > 0) and KEYS[3] or '',
  'active', (maxq > 0) and KEYS[4] or '', 'cap_t', ARGV[3], 'cap_k', ARGV[7], 'job', ARGV[9])
redis.call('PEXPIRE', KEYS[7], tonumber(ARGV[11]))
return {1, '', '0', req[2], req[3], tostring(req[4]), tok[2], tok[3], tostring(tok[4])}
"""

SETTLE = r"""
-- KEYS: 1 reservation; ARGV: 1 now_ms 2 actual tokens. Refund (cost - actual) once.
local r = redis.call('HGETALL', KEYS[1])
if #r == 0 then return 0 end
local h = {}
for i = 1, #r, 2 do h[r[i]] = r[i + 1] end
local now = tonumber(ARGV[1])
local refund = tonumber(h.cost) - tonumber(ARGV[2])
local function give(key, cap)
  if key == '' or cap <= 0 then return end
  local rate = cap / 60000
  local tokens = tonumber(redis.call('HGET', key, 't') or cap)
  local ts = tonumber(redis.call('HGET', key, 's') or now)
  tokens = math.min(cap, tokens + (now - ts) * rate + refund)
  redis.call('HSET', key, 't', tokens, 's', now)
  redis.call('PEXPIRE', key, 120000)
end
give(h.tpm_t, tonumber(h.cap_t))
give(h.tpm_k, tonumber(h.cap_k))
if h.tpd ~= '' and redis.call('EXISTS', h.tpd) == 1 then redis.call('DECRBY', h.tpd, refund) end
if h.active ~= '' then redis.call('ZREM', h.active, h.job) end
redis.call('DEL', KEYS[1])
return 1
"""


@dataclass(frozen=True)
class Limits:
    rpm: int = 0  # 0: unlimited
    tpm: int = 0
    tpd: int = 0
    max_queued: int = 0
    key_rpm: int = 0
    key_tpm: int = 0


@dataclass(frozen=True)
class Decision:
    allowed: bool
    refused: str  # which limit: requests | tokens | tokens_per_day | queued_jobs | reads
    retry_after_s: float | None  # None: waiting cannot help (the request exceeds the limit itself)
    headers: dict[str, str]


def _duration(ms: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 20ms."""
    ms = max(0.0, ms)
    if ms < 1000:
        return f"{int(ms)}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.3g}s"
    return f"{int(s // 60)}m{int(s % 60)}s"


def _headers(
    req_limit: int, req_left: int, req_reset: float, tok_limit: int, tok_left: int, tok_reset: float
) -> dict[str, str]:
    h: dict[str, str] = {}
    if req_limit >= 0:
        h |= {
            "x-ratelimit-limit-requests": str(req_limit),
            "x-ratelimit-remaining-requests": str(max(req_left, 0)),
            "x-ratelimit-reset-requests": _duration(req_reset),
        }
    if tok_limit >= 0:
        h |= {
            "x-ratelimit-limit-tokens": str(tok_limit),
            "x-ratelimit-remaining-tokens": str(max(tok_left, 0)),
            "x-ratelimit-reset-tokens": _duration(tok_reset),
        }
    return h


def _keys(tenant_id: int, key_id: int, job_id: str, day: str) -> list[str]:
    """KEYS of the ADMIT script, in the order it reads them."""
    return [
        redis_keys.tenant_limit(tenant_id, "rpm"),
        redis_keys.tenant_limit(tenant_id, "tpm"),
        redis_keys.tenant_limit(tenant_id, f"tpd:{day}"),
        redis_keys.tenant_limit(tenant_id, "active"),
        redis_keys.key_limit(key_id, "rpm"),
        redis_keys.key_limit(key_id, "tpm"),
        reservation_key(job_id),
    ]


reservation_key = redis_keys.reservation  # what the SETTLE script is given


def _decode(raw: list[Any]) -> Decision:
    def s(x: Any) -> str:
        return x.decode() if isinstance(x, bytes) else str(x)

    allowed = int(raw[0]) == 1
    wait = float(s(raw[2]))
    headers = _headers(int(raw[3]), int(raw[4]), float(s(raw[5])), int(raw[6]), int(raw[7]), float(s(raw[8])))
    if wait == -2:  # tokens per day: until the next UTC midnight
        now = time.time()
        wait = ((now // 86400 + 1) * 86400 - now) * 1000
    return Decision(allowed, s(raw[1]), None if wait < 0 else wait / 1000, headers)


def _args(limits: Limits, cost: int, job_id: str, lease_s: float) -> tuple[list[Any], str]:
    now = time.time()
    day = time.strftime("%Y%m%d", time.gmtime(now))
    argv = [
        int(now * 1000),
        limits.rpm,
        limits.tpm,
        limits.tpd,
        limits.max_queued,
        limits.key_rpm,
        limits.key_tpm,
        cost,
        job_id,
        int(lease_s * 1000),
        2 * 86400 * 1000,
    ]
    return argv, day


async def admit(
    rds: Any, tenant_id: int, key_id: int, job_id: str, limits: Limits, cost: int, lease_s: float = 86400
) -> Decision:
    """Check and take every limit for one job (asyncio client)."""
    argv, day = _args(limits, cost, job_id, lease_s)
    return _decode(await _ADMIT.run_async(rds, _keys(tenant_id, key_id, job_id, day), *argv))


def admit_many(rds: Any, jobs: list[tuple[int, int, str, Limits, int]]) -> list[Decision]:
    """`admit` for several jobs (tenant_id, key_id, job_id, limits, cost) in one round trip (sync
    client; the dispatcher's batch lines). Each is checked and taken on its own, in order."""
    pipe = rds.pipeline(transaction=False)
    for tenant_id, key_id, job_id, limits, cost in jobs:
        argv, day = _args(limits, cost, job_id, 86400)
        pipe.eval(ADMIT, 7, *_keys(tenant_id, key_id, job_id, day), *argv)
    return [_decode(raw) for raw in pipe.execute()]


REQUESTS = r"""
-- Requests per minute alone (GCRA), taken before a body is read. KEYS: 1 tenant 2 key.
-- ARGV: 1 now_ms 2 rpm_t 3 rpm_k. Returns {allowed, limit, remaining, reset_ms, wait_ms} of the tightest.
local now = tonumber(ARGV[1])
local out = {1, -1, -1, '0', '0'}
local takes = {}
for i = 1, 2 do
  local limit = tonumber(ARGV[i + 1])
  if limit > 0 then
    local emission = 60000 / limit
    local tat = tonumber(redis.call('GET', KEYS[i]) or now)
    if tat < now then tat = now end
    local new_tat = tat + emission
    local allow_at = new_tat - 60000
    if now < allow_at then
      return {0, limit, 0, tostring(tat - now), tostring(allow_at - now)}
    end
    local left = math.floor((now - allow_at) / emission)
    if out[2] < 0 or left < out[3] then out = {1, limit, left, tostring(new_tat - now), '0'} end
    takes[#takes + 1] = {KEYS[i], new_tat}
  end
end
for _, t in ipairs(takes) do redis.call('SET', t[1], t[2], 'PX', math.ceil(t[2] - now) + 1) end
return out
"""


PEEK = r"""
-- Read-only: would a job of at least `floor` tokens be refused by tokens/minute, tokens/day or
-- queued jobs right now? Nothing is taken (admission takes it once the prompt is counted).
-- KEYS: 1 tpm_tenant 2 tpd_tenant 3 active_tenant 4 tpm_key. ARGV: 1 now_ms 2 tpm_t 3 tpd 4 maxq 5 tpm_k 6 floor
-- Returns {allowed, which, wait_ms} (wait_ms -1: waiting cannot help, -2: until the next UTC day).
local now, floor = tonumber(ARGV[1]), tonumber(ARGV[6])
local function short(key, cap)
  if cap <= 0 then return nil end
  local rate = cap / 60000
  local tokens = tonumber(redis.call('HGET', key, 't') or cap)
  local ts = tonumber(redis.call('HGET', key, 's') or now)
  tokens = math.min(cap, tokens + (now - ts) * rate)
  if floor <= tokens then return nil end
  if floor > cap then return -1 end
  return (floor - tokens) / rate
end
for _, pair in ipairs({{KEYS[1], tonumber(ARGV[2])}, {KEYS[4], tonumber(ARGV[5])}}) do
  local wait = short(pair[1], pair[2])
  if wait then return {0, 'tokens', tostring(wait)} end
end
local tpd = tonumber(ARGV[3])
if tpd > 0 and tonumber(redis.call('GET', KEYS[2]) or 0) + floor > tpd then return {0, 'tokens_per_day', '-2'} end
local maxq = tonumber(ARGV[4])
if maxq > 0 and redis.call('ZCOUNT', KEYS[3], now, '+inf') >= maxq then return {0, 'queued_jobs', '1000'} end
return {1, '', '0'}
"""

_ADMIT, _REQUESTS, _SETTLE, _PEEK = Lua(ADMIT), Lua(REQUESTS), Lua(SETTLE), Lua(PEEK)


async def take_request(rds: Any, tenant_id: int, key_id: int, rpm: int, key_rpm: int) -> Decision:
    """Take one request from the tenant's and the key's requests-per-minute (the same GCRA state
    `admit` uses), or refuse; nothing else is touched. Cheap enough to run before a body is read."""
    keys = _keys(tenant_id, key_id, "-", "-")
    raw = await _REQUESTS.run_async(rds, (keys[0], keys[4]), int(time.time() * 1000), rpm, key_rpm)

    def s(x: Any) -> str:
        return x.decode() if isinstance(x, bytes) else str(x)

    headers = _headers(int(raw[1]), int(raw[2]), float(s(raw[3])), -1, -1, 0)
    return Decision(int(raw[0]) == 1, "" if int(raw[0]) == 1 else "requests", float(s(raw[4])) / 1000, headers)


async def take_read(rds: Any, tenant_id: int, per_minute: int) -> Decision:
    """One read from the tenant's reads per minute (GCRA, burst = the limit; the REQUESTS script on
    a key of its own), or refuse."""
    key = redis_keys.tenant_limit(tenant_id, "reads")
    raw = await _REQUESTS.run_async(rds, (key, key), int(time.time() * 1000), per_minute, 0)
    wait = raw[4].decode() if isinstance(raw[4], bytes) else str(raw[4])
    return Decision(int(raw[0]) == 1, "" if int(raw[0]) == 1 else "reads", float(wait) / 1000, {})


async def peek(rds: Any, tenant_id: int, key_id: int, limits: Limits, floor: int) -> Decision:
    """Whether a job of at least `floor` tokens would be refused now by the token limits or the queued
    jobs, taking nothing: the refusal before a prompt is tokenized (core/jobs/service.py)."""
    now = time.time()
    keys = _keys(tenant_id, key_id, "-", time.strftime("%Y%m%d", time.gmtime(now)))
    raw = await _PEEK.run_async(
        rds,
        (keys[1], keys[2], keys[3], keys[5]),
        int(now * 1000),
        limits.tpm,
        limits.tpd,
        limits.max_queued,
        limits.key_tpm,
        floor,
    )
    which = raw[1].decode() if isinstance(raw[1], bytes) else str(raw[1])
    wait = float(raw[2].decode() if isinstance(raw[2], bytes) else raw[2])
    if wait == -2:  # tokens per day: until the next UTC midnight
        wait = ((now // 86400 + 1) * 86400 - now) * 1000
    return Decision(int(raw[0]) == 1, which, None if wait < 0 else wait / 1000, {})


async def settle_async(rds: Any, job_id: str, actual_tokens: int) -> None:
    await _SETTLE.run_async(rds, (reservation_key(job_id),), int(time.time() * 1000), actual_tokens)


def settle(rds: Any, job_id: str, actual_tokens: int) -> None:
    """Settle a job's reservation to what it really used (0 releases it all). Idempotent."""
    _SETTLE(rds, (reservation_key(job_id),), int(time.time() * 1000), actual_tokens)
