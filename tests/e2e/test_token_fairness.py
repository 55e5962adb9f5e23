"""Fair by tokens and OpenAI's service tiers, end to end: API, dispatcher and a paced worker (the
engine of a GPU's pace, ops/bench/fairness.py `STACK_ENV`), the `openai` SDK as the client. The shares
are the scheduler's charged tokens of the jobs that ended in the window, read from the ledger; the
five-minute figures and the timings (TTFT beside flex, how fast a 429 comes) are the bench's
(`python -m ops.bench.fairness`, BENCHMARKS.md), not asserted here."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from ops.bench import fairness
from ops.harness import side_redis
from tests.conftest import MODEL, TEST_DB, running_stack

pytestmark = pytest.mark.wallclock  # it waits on a paced engine's sleeps: little CPU of its own


@pytest.fixture(scope="module")
def fair_stack(tmp_path_factory):
    db = TEST_DB.rsplit("/", 1)[0] + "/spool_fairness_e2e"
    with running_stack(
        tmp_path_factory.mktemp("fairness-logs"), db, side_redis("fairness"), **fairness.STACK_ENV
    ) as st:
        yield st, create_engine(db)


def test_equal_weights_share_tokens_and_a_light_tenant_goes_first(fair_stack):
    st, db = fair_stack
    r = fairness.shares_phase(st.base_url, st.keys["admin"], db, (1, 1), seconds=25, concurrency=32, suffix="-e2e")
    assert r["errors"] == {"short": 0, "long": 0}, r["errors"]
    assert 0.9 <= r["ratio"] <= 1.1, r  # by jobs (the old scheduler, and the bypass) it was ~1:30
    assert r["short"]["jobs"] > 10 * r["long"]["jobs"], r
    # Both backlogged throughout: each sample saw both waiting in Postgres.
    assert all(min(s["queued"].values()) > 0 for s in r["samples"]), r["samples"]
    # The bound docs/reliability.md states: twice the largest job's charge plus what is in flight.
    in_flight = 16 * r["largest_job"]
    assert r["worst_gap"] <= 2 * r["largest_job"] + in_flight, r
    # A tenant sending now and then is not queued behind the backlogs: it returns at their lowest
    # counter and goes next.
    assert r["probe_wait_p50"] is not None and r["backlog_wait_p50"] is not None
    assert r["probe_wait_p50"] < r["backlog_wait_p50"] / 3, r


def test_weights_two_to_one_with_a_cap_on_one_tenant(fair_stack):
    st, db = fair_stack
    # The long-prompt tenant at weight 2, capped at 4 in flight (its share needs one or two): before, a
    # capped tenant's requests waited for the scheduler while an uncapped one's went straight to the
    # worker. (Weight 2 on the long side keeps the short tenant's request rate within what this
    # machine's clients send under a full suite: the share is what is asserted, not the client's pace.)
    r = fairness.shares_phase(
        st.base_url, st.keys["admin"], db, (1, 2), seconds=25, concurrency=32, caps=(None, 4), suffix="-e2e"
    )
    assert all(min(s["queued"].values()) > 0 for s in r["samples"]), r["samples"]
    assert 0.45 <= r["ratio"] <= 0.55, r  # short's charged tokens over long's: 1:2


def test_every_object_says_the_tier_that_served_it(fair_stack):
    st, _ = fair_stack
    admin = st.http(st.keys["admin"])
    assert admin.post("/admin/tenants", json={"name": "tiers-vip", "allow_priority": True}).status_code == 201
    vip_key = admin.post("/admin/tenants/tiers-vip/keys", json={"name": "t"}).json()["key"]
    plain_key = st.new_tenant("tiers-plain")
    vip = openai.OpenAI(base_url=st.base_url + "/v1", api_key=vip_key, max_retries=0)
    plain = openai.OpenAI(base_url=st.base_url + "/v1", api_key=plain_key, max_retries=0)
    msgs = [{"role": "user", "content": "Hi"}]

    chat = vip.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, service_tier="priority")
    assert chat.service_tier == "priority"
    # Not allowed priority: served at default, and told so.
    assert (
        plain.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, service_tier="priority").service_tier
        == "default"
    )
    assert (
        plain.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, service_tier="auto").service_tier
        == "default"
    )
    chunks = list(
        plain.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, service_tier="flex", stream=True)
    )
    assert chunks and {c.service_tier for c in chunks} == {"flex"}
    resp = vip.responses.create(model=MODEL, input="Hi", max_output_tokens=4, service_tier="priority")
    assert resp.service_tier == "priority"
    assert vip.responses.retrieve(resp.id).service_tier == "priority"
    done = plain.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"service_tier": "flex"})
    assert done.service_tier == "flex"  # type: ignore[attr-defined]  # an extra field on the legacy object

    # Usage per tier, for the tenant and in /metrics.
    usage = httpx.get(f"{st.base_url}/v1/usage", headers={"Authorization": f"Bearer {plain_key}"}).json()["data"]
    by_tier = {row["service_tier"]: row["requests"] for row in usage}
    assert by_tier == {"default": 2, "flex": 2}, usage
    metrics = httpx.get(f"http://127.0.0.1:{st.metrics_ports['worker']}/metrics").text  # the worker ends jobs
    assert 'spool_service_tier_jobs_total{model="smollm2-135m-instruct",service_tier="priority"}' in metrics


def test_flex_past_its_bound_is_refused_and_priority_overtakes_a_default_backlog(fair_stack):
    st, db = fair_stack
    flex_key = st.new_tenant("flex-heavy")
    body = {"model": MODEL, "prompt": fairness.prompt_ids(50, 1), "max_tokens": 1000, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {flex_key}", "Prefer": "respond-async"}

    # Batch slots (12) run flex requests, each for ~20 s; SPOOL_FLEX_MAX_QUEUED (8) more wait; past that,
    # refused at admission. Sent to be queued (202), so they arrive faster than any can end.
    with httpx.Client(base_url=st.base_url, headers=headers, timeout=60) as c:
        answers = [c.post("/v1/completions", json={**body, "service_tier": "flex"}) for _ in range(40)]
        refused = [a for a in answers if a.status_code == 429]
        assert refused and all(a.status_code in (202, 429) for a in answers), {a.status_code for a in answers}
        for a in refused:
            assert a.json()["error"]["code"] == "resource_unavailable" and a.headers["retry-after"]
        with db.connect() as conn:  # a refused request stored nothing
            stored = conn.execute(
                text("SELECT count(*) FROM jobs j JOIN tenants t ON t.id = j.tenant_id WHERE t.name = 'flex-heavy'")
            ).scalar()
        assert stored == len(answers) - len(refused)
        for a in answers:  # the engine back for what follows
            if a.status_code == 202:
                c.post(f"/v1/jobs/{a.json()['id']}/cancel")

    # A default backlog of 48 outstanding requests; then a priority request: it starts ahead of the
    # default requests that were waiting when it came.
    admin = st.http(st.keys["admin"])
    admin.post("/admin/tenants", json={"name": "prio", "allow_priority": True})
    prio_key = admin.post("/admin/tenants/prio/keys", json={"name": "t"}).json()["key"]
    backlog = fairness.Load("default-backlog", 50, concurrency=48)
    backlog.tenant_id, backlog.key = fairness.make_tenant(st.base_url, st.keys["admin"], "default-backlog-t")
    with fairness.driving(st.base_url, [backlog]):
        threading.Event().wait(4.0)
        c = openai.OpenAI(base_url=st.base_url + "/v1", api_key=prio_key, max_retries=0)
        done = c.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"service_tier": "priority"})
    with db.connect() as conn:
        row = conn.execute(text("SELECT created_at, started_at FROM jobs WHERE id = :i"), {"i": done.id}).one()
        overtaken = conn.execute(
            text("SELECT count(*) FROM jobs WHERE tenant_id = :t AND created_at < :c AND started_at > :s"),
            {"t": backlog.tenant_id, "c": row.created_at, "s": row.started_at},
        ).scalar()
    assert overtaken >= 5, overtaken  # it went past the default requests waiting when it came
