"""The fault harness's schedule is a table (ops/faults.FAULTS) the runner walks: which faults a run
makes, in which order, and that every row names something the injector does."""

from __future__ import annotations

from ops import faults


def _labels(*args, **kw) -> list[str]:
    return [f.label for f in faults.schedule(*args, **kw)]


def test_the_short_run_keeps_to_the_brief_outages_with_kills_spread_among_them():
    assert _labels(short=True) == [
        "worker SIGKILL",
        "redis SIGKILL + restart empty",
        "postgres stop -m immediate + restart",
        "worker SIGKILL",
        "worker SIGKILL",
        "api SIGTERM",
        "api SIGKILL",
        "dispatcher SIGKILL",
    ]  # tests/e2e/test_faults.py counts these 8


def test_the_full_run_has_every_fault_once_and_twenty_kills():
    got = faults.schedule(short=False)
    assert [f for f in got if f is not faults.WORKER_KILL] == list(faults.FAULTS)
    assert got.count(faults.WORKER_KILL) == 20
    assert got[10:12] == list(faults.FAULTS[:2])  # after the first half of the kills


def test_only_picks_rows_by_name_long_ones_included_and_repeats_them():
    once = ["api SIGTERM", "api SIGKILL", "redis-oom refuses writes 30 s (maxmemory 1, noeviction)"]
    assert _labels(short=True, worker_kills=0, only={"api", "redis-oom"}, rounds=2) == once * 2
    assert faults.ONLY == (
        "redis",
        "postgres",
        "api",
        "dispatcher",
        "redis-30s",
        "postgres-30s",
        "redis-oom",
        "redis-misconf",
    )


def test_every_row_names_an_action_of_the_injector_and_starts_with_its_name():
    for f in (faults.WORKER_KILL, *faults.FAULTS):
        assert callable(getattr(faults.Injector, f.action, None)), f
        assert f.label.split()[0] == f.name, f
