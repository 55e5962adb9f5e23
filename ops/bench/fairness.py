"""Fairness by tokens, and the service tiers, measured on the paced engine.

    python -m ops.bench.fairness                        # its own paced stack; 300 s per phase
    python -m ops.bench.fairness --seconds 60 --json out.json
    python -m ops.bench.fairness --url URL --admin-key KEY --database-url DB   # a running stack

Phase `shares` (one per weight pair, `--pairs 1:1,2:1`): tenant `long` sends 2,000-token prompts and
tenant `short` 50-token ones, 16 output tokens each (`ignore_eos`), each through the `openai` SDK with
`--concurrency` requests outstanding, so both stay backlogged; `short` has the pair's first weight and
`long` the second. A third tenant, `probe`, sends one streamed request every `--probe-every` seconds
and its TTFT and queue wait are recorded. From the ledger, every `--sample` seconds, each tenant's
charged tokens (the unit of core/jobs/scheduler.py, whose docstring gives the formula)
of the jobs that ended in the window: each tenant's share over time against its weight's, the final
ratio, and the worst difference in served charge over weight between the two, seen at any sample.

Phase `tiers`: a default tenant's TTFT p50 (a 50-token prompt, and a 1,000-token chat turn) alone,
then beside a flex backlog (a tenant keeping
2 x `SPOOL_FLEX_MAX_QUEUED` flex requests outstanding: how long each 429 took), then a `priority`
tenant's queue wait beside a default backlog against that backlog's own.

The stack (`--stack`, the default without `--url`): API, dispatcher and one paced worker as the tests
start them (ops/harness.running_stack) with `STACK_ENV`, on a database of its own and a private Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, create_engine, text

from core.jobs.scheduler import Weights

MODEL = "smollm2-135m-instruct"
# A GPU's pace, slow enough that the engine, not this machine's two cores, is what runs out: 8 slots,
# a 20 ms step, prefill at 10,000 tokens a second (a 2,000-token prompt holds the engine 0.2 s).
STACK_ENV = {
    "SPOOL_ENGINE": "paced",
    "SPOOL_MAX_BATCH": "8",
    "SPOOL_PACED_STEP_MS": "20",
    "SPOOL_PACED_SEQ_MS": "0.25",
    "SPOOL_PACED_PREFILL_TPS": "10000",
    "SPOOL_N_CTX": "4096",
    "SPOOL_FLEX_MAX_QUEUED": "8",
    "SPOOL_LOG_FORMAT": "text",
}
W = Weights()


@dataclass
class Load:
    name: str
    prompt_tokens: int
    weight: int = 1
    max_tokens: int = 16
    cap: int | None = None
    concurrency: int = 48
    tier: str | None = None
    tenant_id: int = 0
    key: str = ""
    errors: list[str] = field(default_factory=list)


def prompt_ids(n: int, salt: int) -> list[int]:
    """n token ids, distinct per tenant and request (no prefix shared across them: no cache hits)."""
    return [100 + (salt * 7919 + i * 31) % 40000 for i in range(n)]


def make_tenant(url: str, admin_key: str, name: str, **limits: Any) -> tuple[int, str]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as admin:
        r = admin.post("/admin/tenants", json={"name": name, **{k: v for k, v in limits.items() if v is not None}})
        r.raise_for_status()
        key = admin.post(f"/admin/tenants/{name}/keys", json={"name": "fairness"}).json()["key"]
        return r.json()["id"], key


def _drive(url: str, load: Load, stop: threading.Event, salt: int) -> None:
    """One closed-loop client: a request, its answer, the next, until `stop`."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=load.key, max_retries=0, timeout=300)
    n = 0
    extra: dict[str, Any] = {"ignore_eos": True}
    if load.tier:
        extra["service_tier"] = load.tier
    while not stop.is_set():
        n += 1
        try:
            client.completions.create(
                model=MODEL,
                prompt=prompt_ids(load.prompt_tokens, salt * 100_003 + n),
                max_tokens=load.max_tokens,
                temperature=0,
                extra_body=extra,
            )
        except openai.APIError as exc:  # counted; a refusal is the flex phase's measure, not a failure
            load.errors.append(type(exc).__name__)
            time.sleep(0.05)


@contextlib.contextmanager
def driving(url: str, loads: list[Load]) -> Iterator[None]:
    stop = threading.Event()
    threads = [
        threading.Thread(target=_drive, args=(url, load, stop, i * 1000 + c), daemon=True)
        for i, load in enumerate(loads)
        for c in range(load.concurrency)
    ]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(330)


_SERVED = text("""
SELECT tenant_id, count(*) AS jobs,
       coalesce(sum((usage->>'prompt_tokens')::bigint), 0) AS prompt,
       coalesce(sum((usage->>'cached_tokens')::bigint), 0) AS cached,
       coalesce(sum((usage->>'completion_tokens')::bigint), 0) AS output
FROM jobs
WHERE tenant_id = ANY(:tenants) AND state = 'succeeded' AND finished_at > :since AND finished_at <= :until
GROUP BY tenant_id
""")


def served(db: Engine, tenants: list[int], since: Any, until: Any) -> dict[int, dict[str, float]]:
    """Each tenant's jobs that ended in (since, until]: how many, raw tokens, and charged tokens."""
    with db.connect() as conn:
        rows = conn.execute(_SERVED, {"tenants": tenants, "since": since, "until": until}).all()
    out = {t: {"jobs": 0, "tokens": 0, "charged": 0.0} for t in tenants}
    for r in rows:
        usage = {"prompt_tokens": r.prompt, "cached_tokens": r.cached, "completion_tokens": r.output}
        out[r.tenant_id] = {"jobs": r.jobs, "tokens": r.prompt + r.output, "charged": W.served(usage)}
    return out


def queue_waits(db: Engine, tenants: list[int], since: Any) -> list[float]:
    """Seconds from stored to started of the tenants' jobs created after `since`."""
    q = text(
        "SELECT extract(epoch FROM started_at - created_at) FROM jobs WHERE tenant_id = ANY(:t)"
        " AND started_at IS NOT NULL AND created_at > :since"
    )
    with db.connect() as conn:
        return [float(w) for w in conn.execute(q, {"t": tenants, "since": since}).scalars()]


def _now(db: Engine) -> Any:
    with db.connect() as conn:
        return conn.execute(text("SELECT clock_timestamp()")).scalar()


def _ttft(http: httpx.Client, body: dict[str, Any]) -> float:
    """Seconds to the first chunk of one streamed completion, read to its end."""
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream carried no chunk")
    return first


def _probe(url: str, key: str, every: float, stop: threading.Event, ttfts: list[float]) -> None:
    """One streamed 50-token request every `every` s (the light interactive tenant)."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        n = 0
        while not stop.wait(every):
            n += 1
            body = {"model": MODEL, "prompt": prompt_ids(50, 9_000_000 + n), "max_tokens": 4, "stream": True}
            ttfts.append(_ttft(http, body))


def shares_phase(
    url: str,
    admin_key: str,
    db: Engine,
    weights: tuple[int, int],
    seconds: float,
    warmup: float = 5.0,
    sample: float = 5.0,
    concurrency: int = 48,
    caps: tuple[int | None, int | None] = (None, None),
    suffix: str = "",
    probe_every: float = 2.0,
) -> dict[str, Any]:
    """Two backlogged tenants of 50- and 2,000-token prompts at `weights` (short, long), and a probe."""
    short = Load(f"short-{weights[0]}{weights[1]}{suffix}", 50, weights[0], cap=caps[0], concurrency=concurrency)
    long = Load(f"long-{weights[0]}{weights[1]}{suffix}", 2000, weights[1], cap=caps[1], concurrency=concurrency)
    for load in (short, long):
        load.tenant_id, load.key = make_tenant(url, admin_key, load.name, weight=load.weight, max_concurrent=load.cap)
    probe_id, probe_key = make_tenant(url, admin_key, f"probe-{weights[0]}{weights[1]}{suffix}")
    tenants = [short.tenant_id, long.tenant_id]
    samples: list[dict[str, Any]] = []
    ttfts: list[float] = []
    stop = threading.Event()
    with driving(url, [short, long]):
        time.sleep(warmup)
        since = _now(db)
        prober = threading.Thread(target=_probe, args=(url, probe_key, probe_every, stop, ttfts), daemon=True)
        prober.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(sample)
            got = served(db, tenants, since, _now(db))
            with db.connect() as conn:  # how many of each wait in Postgres: backlogged, or not
                queued: dict[int, int] = dict(
                    conn.execute(
                        text(
                            "SELECT tenant_id, count(*) FROM jobs WHERE tenant_id = ANY(:t) AND state = 'queued'"
                            " GROUP BY tenant_id"
                        ),
                        {"t": tenants},
                    ).all()
                )
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 1),
                    **{str(t): got[t] for t in tenants},
                    "queued": {str(t): queued.get(t, 0) for t in tenants},
                }
            )
        stop.set()
        prober.join(60)
        until = _now(db)
    final = served(db, tenants, since, until)
    a, b = final[short.tenant_id]["charged"], final[long.tenant_id]["charged"]
    # The worst gap, in charged tokens over weight, at any sample (both backlogged throughout).
    worst = max(
        (abs(s[str(short.tenant_id)]["charged"] / short.weight - s[str(long.tenant_id)]["charged"] / long.weight))
        for s in samples
    )
    waits, backlog_waits = queue_waits(db, [probe_id], since), queue_waits(db, tenants, since)
    return {
        "weights": {"short": short.weight, "long": long.weight},
        "caps": {"short": short.cap, "long": long.cap},
        "seconds": seconds,
        "short": final[short.tenant_id],
        "long": final[long.tenant_id],
        "ratio": a / b if b else float("inf"),  # short's charged tokens over long's
        "expected_ratio": short.weight / long.weight,
        "worst_gap": worst,
        "largest_job": W.estimate(2016, 16, 1, 1),
        "samples": samples,
        "probe_ttft_p50": statistics.median(ttfts) if ttfts else None,
        "probe_ttft_max": max(ttfts) if ttfts else None,
        "probe_wait_p50": statistics.median(waits) if waits else None,
        "backlog_wait_p50": statistics.median(backlog_waits) if backlog_waits else None,
        "errors": {"short": len(short.errors), "long": len(long.errors)},
    }


def _ttft_p50(
    url: str, key: str, n: int, tier: str | None = None, every: float = 0.5, prompt_tokens: int = 50
) -> list[float]:
    out: list[float] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        for i in range(n):
            ids = prompt_ids(prompt_tokens, 7_000_000 + prompt_tokens * 1000 + i)
            body: dict[str, Any] = {"model": MODEL, "prompt": ids, "max_tokens": 4}
            body |= {"stream": True, **({"service_tier": tier} if tier else {})}
            out.append(_ttft(http, body))
            time.sleep(every)
    return out


def flex_refusals(url: str, key: str, n: int) -> list[tuple[int, float, str | None]]:
    """n flex requests at once: (status, seconds to the answer, Retry-After) of each, the 429s first."""
    results: list[tuple[int, float, str | None]] = []

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": prompt_ids(50, 5_000_000 + i), "max_tokens": 16, "service_tier": "flex"}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as http:
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={**body, "ignore_eos": True})
            results.append((r.status_code, time.perf_counter() - t0, r.headers.get("retry-after")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(330)
    return sorted(results, key=lambda r: (r[0] != 429, r[1]))


def tiers_phase(url: str, admin_key: str, db: Engine, samples: int = 16, suffix: str = "") -> dict[str, Any]:
    _, dkey = make_tenant(url, admin_key, f"default{suffix}")
    _, fkey = make_tenant(url, admin_key, f"flex{suffix}")
    # Two request sizes: a bare 50-token prompt, and a chat turn with its history (1,000 tokens).
    alone = _ttft_p50(url, dkey, samples)
    alone_turn = _ttft_p50(url, dkey, samples, prompt_tokens=1000)
    flex_load = Load(f"flexload{suffix}", 50, concurrency=24, tier="flex", max_tokens=64)
    flex_load.tenant_id, flex_load.key = make_tenant(url, admin_key, flex_load.name)
    with driving(url, [flex_load]):
        time.sleep(3.0)
        beside = _ttft_p50(url, dkey, samples)
        beside_turn = _ttft_p50(url, dkey, samples, prompt_tokens=1000)
        refusals = flex_refusals(url, fkey, 12)
    backlog = Load(f"backlog{suffix}", 50, concurrency=24)
    backlog.tenant_id, backlog.key = make_tenant(url, admin_key, backlog.name)
    pid, pkey = make_tenant(url, admin_key, f"priority{suffix}", allow_priority=True)
    with driving(url, [backlog]):
        time.sleep(3.0)
        since = _now(db)
        prio = _ttft_p50(url, pkey, samples // 2, tier="priority")
        with db.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT tenant_id, service_tier, extract(epoch FROM started_at - created_at) AS wait FROM jobs"
                    " WHERE tenant_id = ANY(:t) AND created_at > :since AND started_at IS NOT NULL"
                ),
                {"t": [pid, backlog.tenant_id], "since": since},
            ).all()
    p_waits = [float(r.wait) for r in rows if r.tenant_id == pid]
    b_waits = [float(r.wait) for r in rows if r.tenant_id == backlog.tenant_id]
    refused = [r for r in refusals if r[0] == 429]
    return {
        "default_ttft_p50_alone": statistics.median(alone),
        "default_ttft_p50_beside_flex": statistics.median(beside),
        "turn_ttft_p50_alone": statistics.median(alone_turn),
        "turn_ttft_p50_beside_flex": statistics.median(beside_turn),
        "flex_refused": len(refused),
        "flex_refusal_s_max": max((r[1] for r in refused), default=None),
        "flex_retry_after": sorted({r[2] for r in refused if r[2]}),
        "flex_statuses": sorted({r[0] for r in refusals}),
        "priority_ttft_p50": statistics.median(prio),
        "priority_wait_p50": statistics.median(p_waits) if p_waits else None,
        "priority_tiers": sorted({r.service_tier for r in rows if r.tenant_id == pid}),
        "default_backlog_wait_p50": statistics.median(b_waits) if b_waits else None,
    }


@contextlib.contextmanager
def stack() -> Iterator[tuple[str, str, str]]:
    """(url, admin key, database URL) of a paced stack of the bench's own."""
    from ops import harness
    from ops.bench.paced import private_redis

    db_url = harness.TEST_DB.rsplit("/", 1)[0] + "/spool_fairness"
    logdir = Path(tempfile.mkdtemp(prefix="spool-fairness-logs-"))
    env = {**STACK_ENV, "SPOOL_LEASE_S": "30", "SPOOL_DISPATCH_TIMEOUT_S": "60"}
    with (
        private_redis() as (redis_url, _),
        harness.running_stack(logdir, db_url, redis_url, (), harness.ROOT, **env) as st,
    ):
        yield st.base_url, st.keys["admin"], db_url


def report(results: dict[str, Any]) -> str:
    lines = []
    for r in results.get("shares", []):
        lines.append(
            f"weights short:long {r['weights']['short']}:{r['weights']['long']} (caps {r['caps']}),"
            f" {r['seconds']:.0f} s:"
            f" charged {r['short']['charged']:.0f} vs {r['long']['charged']:.0f} = {r['ratio']:.3f}"
            f" (expected {r['expected_ratio']:.2f}); jobs {r['short']['jobs']} vs {r['long']['jobs']};"
            f" worst gap {r['worst_gap']:.0f} (one long job {r['largest_job']:.0f});"
            f" probe TTFT p50 {1000 * (r['probe_ttft_p50'] or 0):.0f} ms,"
            f" wait p50 {1000 * (r['probe_wait_p50'] or 0):.0f} ms"
            f" against the backlog's {1000 * (r['backlog_wait_p50'] or 0):.0f} ms"
        )
    t = results.get("tiers")
    if t:
        lines.append(
            f"default TTFT p50 alone {1000 * t['default_ttft_p50_alone']:.0f} ms, beside flex"
            f" {1000 * t['default_ttft_p50_beside_flex']:.0f} ms"
            f" (1,000-token turn {1000 * t['turn_ttft_p50_alone']:.0f}"
            f" / {1000 * t['turn_ttft_p50_beside_flex']:.0f} ms); flex refused {t['flex_refused']}/12, slowest 429"
            f" {1000 * (t['flex_refusal_s_max'] or 0):.0f} ms; priority wait p50"
            f" {1000 * (t['priority_wait_p50'] or 0):.0f} ms against the default backlog's"
            f" {1000 * (t['default_backlog_wait_p50'] or 0):.0f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--admin-key")
    ap.add_argument("--database-url")
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--pairs", default="1:1,2:1", help="short:long weights, one phase each")
    ap.add_argument("--concurrency", type=int, default=48, help="requests each backlogged tenant keeps outstanding")
    ap.add_argument("--phases", default="shares,tiers")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    own = stack() if not args.url else contextlib.nullcontext((args.url, args.admin_key, args.database_url))
    results: dict[str, Any] = {"shares": []}
    with own as (url, admin_key, db_url):
        db = create_engine(db_url)
        suffix = f"-{int(time.time()) % 100000}"
        if "shares" in args.phases:
            for pair in args.pairs.split(","):
                a, b = (int(x) for x in pair.split(":"))
                r = shares_phase(url, admin_key, db, (a, b), args.seconds, concurrency=args.concurrency, suffix=suffix)
                results["shares"].append(r)
                print(report({"shares": [r]}), flush=True)
        if "tiers" in args.phases:
            results["tiers"] = tiers_phase(url, admin_key, db, suffix=suffix)
            print(report({"tiers": results["tiers"]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
