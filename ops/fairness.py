"""Fairness scenario: does one tenant's huge backlog slow another tenant's interactive requests,
and do saturating tenants share the workers by weight?

Used by tests/e2e/test_fairness.py and runnable against any Spool stack:

    python -m ops.fairness --url http://127.0.0.1:8000 --admin-key sk-spool-... \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/spool --backlogs 200,2000

Backlogs are written straight into the ledger as batch jobs (what the Batches API does), so the
scenario measures scheduling, not upload speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import httpx
from sqlalchemy import Engine, create_engine, func, select, update

from core.generation.params import GenerationParams
from core.infra.orm import Job, JobState, Tenant
from core.jobs import transitions as jobs

MODEL = "smollm2-135m-instruct"
PROMPT_IDS = [19556, 30]  # two tokens: the work is scheduling, not generation


def make_tenant(url: str, admin_key: str, name: str, **limits: int) -> tuple[int, str]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
        r = admin.post("/admin/tenants", json={"name": name, **limits})
        r.raise_for_status()
        key = admin.post(f"/admin/tenants/{name}/keys", json={"name": "fairness"}).json()["key"]
        return r.json()["id"], key


def insert_backlog(db: Engine, tenant_id: int, n: int, max_tokens: int = 1) -> None:
    params = GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True).to_json()
    rows = []
    for _ in range(n):
        job = jobs.new_job(
            tenant_id=tenant_id,
            model=MODEL,
            params=params,
            prompts=[{"ids": PROMPT_IDS, "text": None}],
            stream=False,
            kind="batch",
        )
        rows.append({c.key: getattr(job, c.key) for c in Job.__table__.columns if getattr(job, c.key) is not None})
    with db.begin() as conn:
        conn.execute(Job.__table__.insert(), rows)


def cancel_queued(db: Engine, tenant_id: int) -> None:
    with db.begin() as conn:
        conn.execute(
            update(Job)
            .where(Job.tenant_id == tenant_id, Job.state == JobState.queued.value)
            .values(state=JobState.cancelled.value, finished_at=func.now())
        )


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
    return [d.total_seconds() for d in rows]


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
    out = [{"backlog": 0, "waits": interactive_waits(url, b_key, db)}]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--admin-key", required=True)
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--backlogs", default="200,2000")
    ap.add_argument("--seconds", type=float, default=20)
    args = ap.parse_args()
    db = create_engine(args.database_url)
    suffix = "-" + uuid.uuid4().hex[:6]
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
