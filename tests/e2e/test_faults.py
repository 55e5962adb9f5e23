"""The fault-injection harness, short form (ops/faults.py): a Spool on its own Postgres and Redis,
under streaming, async and batch load (the openai SDK's completions, chats and background
responses among it), while its worker is SIGKILLed mid-generation, Redis is
killed and restarted empty, Postgres is stopped hard and restarted, the API is SIGTERMed and
SIGKILLed mid-stream and the dispatcher is killed. Nothing may be lost, doubled, wrong or stuck,
and no 5xx may reach a client. The full run (20 worker kills) is `python -m ops.faults`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ops import faults, history

pytestmark = [
    pytest.mark.skipif(
        shutil.which("redis-server") is None
        or not list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        or (os.geteuid() == 0 and shutil.which("runuser") is None),
        reason="needs redis-server and PostgreSQL's server binaries",
    ),
    # solo: its schedule is timed against a load of a fixed size, so it runs apart from the shards (beside
    # the lint, which holds one core).
    # Beside them (the wallclock shard, 2026-11-28) it failed one fresh-clone run in four (no stream
    # mid-generation within 20 s when an API kill was due; kills now wait faults.KILL_WAIT_S), and where
    # it passed it cost more than it saved: 181 s there, the shards 2:00 longer, against 73 s alone.
    pytest.mark.solo,
]


def test_short_fault_run_loses_doubles_and_garbles_nothing(tmp_path):
    workdir = tmp_path / "faults"
    workdir.mkdir()
    report = faults.run(short=True, workdir=workdir)
    print(report)
    assert report.problems == [] and report.clean, report.problems
    assert len(report.faults) == 8  # 3 worker kills + redis, postgres, api x2, dispatcher: all happened
    assert report.requests >= 40 and report.batch_lines == 24
    assert report.resumed_jobs >= 1  # the worker kills really hit running jobs, which resumed
    assert report.reattached_streams >= 1  # API restarts really cut streams that clients re-attached
    assert all(report.by_client.get(k) for k in faults.SDK_KINDS), report.by_client  # the openai SDK was a client
    assert report.by_client.get("keyless"), report.by_client  # and bursts without a key (group commit)
    # Every stream's events, connection by connection, recorded and checked (ops/history.py): the
    # re-attached ones among them, so a resume point was looked at, not only the final text.
    assert report.streams_checked >= 4 and report.stream_connections > report.streams_checked, report
    again = history.check_file(workdir / "history.jsonl")
    assert (again.histories, again.events, again.repeated, again.skipped) == (
        report.streams_checked,
        report.stream_events,
        0,
        0,
    )
