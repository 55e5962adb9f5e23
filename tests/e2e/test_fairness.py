"""One tenant's backlog must not slow another's interactive requests; weights split the workers."""

from __future__ import annotations

from ops.fairness import backlog_scenario, weighted_split


def test_interactive_wait_does_not_grow_with_another_tenants_backlog(stack, db):
    rows = backlog_scenario(stack.base_url, stack.keys["admin"], db, [200, 2000])
    base, _small, big = rows
    assert big["pending"] > 1000, "the backlog drained before it was measured"
    for row in rows:
        assert row["median_s"] < 1.0, rows
    assert big["median_s"] < base["median_s"] + 0.5, rows  # flat, not growing with the backlog
    print({r["backlog"]: round(r["median_s"] * 1000) for r in rows})


def test_weights_split_completed_work(stack, db):
    heavy, light = weighted_split(stack.base_url, stack.keys["admin"], db, seconds=12, per_tenant=3000)
    assert light > 10, (heavy, light)
    assert 2.0 <= heavy / light <= 4.5, (heavy, light)
