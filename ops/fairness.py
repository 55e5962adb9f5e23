"""Fairness scenario: does one tenant's huge backlog slow another tenant's interactive requests,
and do saturating tenants share the workers by weight?

Used by tests/e2e/test_fairness.py and runnable against any Spool stack:

    python -m ops.fairness --url http://127.0.0.1:8000 --admin-key sk-spool-... \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/spool --backlogs 200,2000

    # Interactive time-to-first-token on an idle stack and under another tenant's batch of real
    # (128-token) lines, and the batch's throughput alone and under one interactive request a second:
    python -m ops.fairness --scenario ttft --url ... --admin-key ... --database-url ... --lines 64

Backlogs are written straight into the ledger as batch jobs (what the Batches API does), so the
scenario measures scheduling, not upload speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any, cast

import httpx
from sqlalchemy import Engine, create_engine, func, insert, select

from core.generation.params import GenerationParams
from core.generation.prompt import Prompt
from core.infra.orm import Job, Tenant
from core.jobs import transitions as jobs
from core.states import JobKind, JobState

MODEL = "smollm2-135m-instruct"
PROMPT_IDS = [19556, 30]  # two tokens: the work is scheduling, not generation


def make_tenant(url: str, admin_key: str, name: str, **limits: int) -> tuple[int, str]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
        r = admin.post("/admin/tenants", json={"name": name, **limits})
        r.raise_for_status()
        key = admin.post(f"/admin/tenants/{name}/keys", json={"name": "fairness"}).json()["key"]
        return r.json()["id"], key


def insert_backlog(
    db: Engine, tenant_id: int, n: int, max_tokens: int = 1, prompts: list[list[int]] | None = None
) -> list[str]:
    params = GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True).to_json()
    rows = []
    for i in range(n):
        ids = prompts[i % len(prompts)] if prompts else PROMPT_IDS
        row = jobs.new_row(
            tenant_id=tenant_id,
            model=MODEL,
            params=params,
            prompts=[Prompt(ids).to_json()],
            stream=False,
            kind=JobKind.batch,
            reserved_tokens=len(ids) + max_tokens,  # what the validator reserves: the fair dispatcher's estimate
        )
        rows.append({k: v for k, v in row.items() if v is not None})  # None left out: JSONB would store JSON null
    with db.begin() as conn:
        conn.execute(insert(Job), rows)
    return [r["id"] for r in rows]


def cancel_queued(db: Engine, tenant_id: int) -> None:
    with db.begin() as conn:
        conn.execute(jobs.cancel_queued_of_tenant(tenant_id))


def interactive_waits(url: str, key: str, db: Engine, n: int = 8) -> list[float]:
    """Queue wait (created -> started) of n interactive requests sent one after another."""
    ids = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        for _ in range(n):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
            r.raise_for_status()
            ids.append(r.json()["id"])
    with db.connect() as conn:
        rows = conn.execute(select(Job.started_at - Job.created_at).where(Job.id.in_(ids))).scalars().all()
    return [cast(timedelta, d).total_seconds() for d in rows]  # started_at - created_at: an interval


def done_count(db: Engine, tenant_id: int) -> int:
    with db.connect() as conn:
        return (
            conn.scalar(
                select(func.count())
                .select_from(Job)
                .where(Job.tenant_id == tenant_id, Job.state == JobState.succeeded.value)
            )
            or 0
        )


def weighted_split(
    url: str, admin_key: str, db: Engine, seconds: float = 15, per_tenant: int = 400, suffix: str = ""
) -> tuple[int, int]:
    """Tenants of weight 3 and 1 both saturate the workers; returns jobs each completed."""
    heavy, _ = make_tenant(url, admin_key, f"weight3{suffix}", weight=3)
    light, _ = make_tenant(url, admin_key, f"weight1{suffix}", weight=1)
    insert_backlog(db, heavy, per_tenant)
    insert_backlog(db, light, per_tenant)
    time.sleep(seconds)
    counts = done_count(db, heavy), done_count(db, light)
    cancel_queued(db, heavy)
    cancel_queued(db, light)
    return counts


def backlog_scenario(url: str, admin_key: str, db: Engine, backlogs: list[int], suffix: str = "") -> list[dict]:
    """Tenant A's batch backlog grows; tenant B's interactive queue wait is measured at each size."""
    a, _ = make_tenant(url, admin_key, f"bulk{suffix}")
    _, b_key = make_tenant(url, admin_key, f"interactive{suffix}")
    out: list[dict[str, Any]] = [{"backlog": 0, "waits": interactive_waits(url, b_key, db)}]
    queued = 0
    for size in backlogs:
        insert_backlog(db, a, size - queued)
        queued = size
        time.sleep(1.0)  # let the dispatcher start feeding A's backlog
        with db.connect() as conn:
            pending = conn.scalar(
                select(func.count()).select_from(Job).where(Job.tenant_id == a, Job.state == JobState.queued.value)
            )
        out.append({"backlog": size, "pending": pending, "waits": interactive_waits(url, b_key, db)})
    cancel_queued(db, a)
    for row in out:
        row["median_s"] = statistics.median(row["waits"])
        row["max_s"] = max(row["waits"])
    return out


def ttft_once(http: httpx.Client, prompt: str = "Hello, my name is", max_tokens: int = 8) -> float:
    """Client-side time to the first chunk with text of one streaming greedy request."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first


def ttft_series(url: str, key: str, n: int, every_s: float = 1.0, until=None) -> list[float]:
    """n requests, one every `every_s` (or until `until()` is true, when given, at least n)."""
    out: list[float] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        while len(out) < n or (until is not None and not until()):
            t0 = time.perf_counter()
            out.append(ttft_once(http))
            time.sleep(max(0.0, every_s - (time.perf_counter() - t0)))
            if until is not None and until() and len(out) >= n:
                break
    return out


def _batch_rate(db: Engine, ids: list[str]) -> tuple[float, int]:
    """(generated tokens per second over the batch's whole span, lines succeeded)."""
    with db.connect() as conn:
        rows = conn.execute(select(Job.started_at, Job.finished_at, Job.usage, Job.state).where(Job.id.in_(ids))).all()
    done = [r for r in rows if r.state == JobState.succeeded.value]
    span = (max(r.finished_at for r in done) - min(r.started_at for r in done)).total_seconds()
    tokens = sum(r.usage["completion_tokens"] for r in done)
    return tokens / span, len(done)


def _all_done(db: Engine, ids: list[str]):
    def check() -> bool:
        with db.connect() as conn:
            live = conn.scalar(
                select(func.count())
                .select_from(Job)
                .where(Job.id.in_(ids), Job.state.in_(["queued", "dispatched", "running"]))
            )
        return live == 0

    return check


def _wait(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the batch did not finish")
        time.sleep(0.5)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def ttft_scenario(
    url: str,
    admin_key: str,
    db: Engine,
    lines: int = 64,
    line_tokens: int = 128,
    samples: int = 12,
    suffix: str = "",
    rounds: int = 2,
) -> dict:
    """Tenant B's interactive TTFT idle and under tenant A's batch; A's throughput with and without B."""
    a, a_key = make_tenant(url, admin_key, f"bulk-ttft{suffix}")
    _, b_key = make_tenant(url, admin_key, f"chat-ttft{suffix}")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {a_key}"}) as http:
        texts = [
            "Write a long story about a lighthouse keeper.",
            "Explain in detail how bridges are built.",
            "Describe the history of the bicycle.",
            "List many ideas for a rainy afternoon and explain each.",
        ]
        prompts = [http.post("/tokenize", json={"content": t}).json()["tokens"] for t in texts]
    idle = ttft_series(url, b_key, samples)
    alone_rates: list[float] = []
    loaded_rates: list[float] = []
    loaded: list[float] = []
    done: list[int] = []
    for _ in range(rounds):  # interleaved: alone, loaded, alone, loaded (machines drift between runs)
        ids = insert_backlog(db, a, lines, line_tokens, prompts)
        _wait(_all_done(db, ids), 1800)
        rate, n = _batch_rate(db, ids)
        alone_rates.append(rate)
        done.append(n)
        ids = insert_backlog(db, a, lines, line_tokens, prompts)
        time.sleep(3.0)  # let the batch fill the worker before measuring
        loaded += ttft_series(url, b_key, samples, 1.0, until=_all_done(db, ids))
        _wait(_all_done(db, ids), 1800)
        rate, n = _batch_rate(db, ids)
        loaded_rates.append(rate)
        done.append(n)
    alone_rate, loaded_rate = statistics.median(alone_rates), statistics.median(loaded_rates)
    return {
        "idle_ttft_s": idle,
        "loaded_ttft_s": loaded,
        "idle_p50": statistics.median(idle),
        "idle_p99": _pct(idle, 0.99),
        "loaded_p50": statistics.median(loaded),
        "loaded_p99": _pct(loaded, 0.99),
        "loaded_max": max(loaded),
        "batch_tok_s_alone": alone_rate,
        "batch_tok_s_loaded": loaded_rate,
        "throughput_ratio": loaded_rate / alone_rate,
        "batch_tok_s_alone_runs": alone_rates,
        "batch_tok_s_loaded_runs": loaded_rates,
        "lines_done": done,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--admin-key", required=True)
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--backlogs", default="200,2000")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--scenario", choices=["backlog", "ttft"], default="backlog")
    ap.add_argument("--lines", type=int, default=64)
    ap.add_argument("--line-tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    db = create_engine(args.database_url)
    suffix = "-" + uuid.uuid4().hex[:6]
    if args.scenario == "ttft":
        r = ttft_scenario(args.url, args.admin_key, db, args.lines, args.line_tokens, args.samples, suffix, args.rounds)
        print(json.dumps(r, indent=2))
        print(
            f"interactive TTFT idle p50 {r['idle_p50'] * 1000:.0f} ms p99 {r['idle_p99'] * 1000:.0f} ms; under a "
            f"batch of {args.lines}x{args.line_tokens} tokens p50 {r['loaded_p50'] * 1000:.0f} ms p99 "
            f"{r['loaded_p99'] * 1000:.0f} ms max {r['loaded_max'] * 1000:.0f} ms; batch {r['batch_tok_s_alone']:.1f} "
            f"tok/s alone, {r['batch_tok_s_loaded']:.1f} under 1 req/s ({r['throughput_ratio']:.2f}x)"
        )
        return
    for row in backlog_scenario(args.url, args.admin_key, db, [int(x) for x in args.backlogs.split(",")], suffix):
        print(
            f"A's backlog {row['backlog']:>6} (still queued {row.get('pending', 0):>6}): B's queue wait median "
            f"{row['median_s'] * 1000:.0f} ms, max {row['max_s'] * 1000:.0f} ms"
        )
    heavy, light = weighted_split(args.url, args.admin_key, db, args.seconds, suffix=suffix)
    print(f"weights 3:1 over {args.seconds:.0f}s: completed {heavy} vs {light} = {heavy / max(light, 1):.2f}:1")
    with db.connect() as conn:
        conn.execute(select(Tenant.id).limit(1))


if __name__ == "__main__":
    main()
