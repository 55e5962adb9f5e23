"""Issue 53, CI's short run of the fleet scenarios (ops/fleet.py) on the cluster harness's hosts: two
worker hosts of one CPU thread each, two API hosts behind HAProxy. Multi-turn chat sessions through the
`openai` SDK with prefix affinity off and on (fresh workers each), the worker host holding most sessions
SIGKILLed mid-run, a hot `prompt_cache_key` that spills, and the model scaled from zero with the
harness starting a worker when the dispatcher wants one. `python -m ops.fleet` is the full run
(20 sessions x 5 turns; its figures in BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from ops import cluster, fleet

pytestmark = pytest.mark.skipif(cluster.missing_tools() is not None, reason=str(cluster.missing_tools()))


def test_the_fleet_keeps_sessions_warm_survives_a_worker_and_scales_from_zero(tmp_path):
    report = fleet.run(fleet.SHORT, tmp_path / "fleet")
    assert report.clean, report.problems
    on, off = report.runs["affinity_on"], report.runs["affinity_off"]
    # Every turn after a session's first finds its history cached on its worker; with affinity off
    # about half do (two workers).
    assert on["failed"] == off["failed"] == 0
    assert on["cached_ratio_later_turns"] >= 0.9, on
    assert off["cached_ratio_later_turns"] < on["cached_ratio_later_turns"] - 0.15, off
    assert on["ttft_p50_later_turns_s"] < off["ttft_p50_later_turns_s"]
    assert len(on["sessions_by_host"]) == 2, on  # the sessions spread over both workers
    # A worker host SIGKILLed once every session had its first turn: nothing lost, repeated or wrong
    # (every turn's text the undisturbed run's; every stream's events checked), and each of its
    # sessions' turns sent afterwards served by the other host.
    kill = report.runs["worker_kill"]
    assert kill["failed"] == kill["wrong"] == kill["repeated"] == kill["skipped"] == 0, kill
    assert kill["streams_checked"] == fleet.SHORT.sessions * fleet.SHORT.turns
    assert kill["sessions_of_killed_host"] >= 1 and kill["served_by_the_other"] == kill["their_later_turns"] >= 1
    # One key past its rate: both workers served it.
    assert len(report.runs["hot_key"]["by_host"]) == 2
    # At zero workers nothing was refused; the first token came once the started worker was up.
    cold = report.runs["from_zero"]
    assert cold["refused"] == 0 and cold["first_ttft_s"] >= cold["worker_start_s"]
    # Nothing of the cluster is left behind: namespaces, links, processes.
    assert not [n for n in cluster._ip("netns", "list").split() if n.startswith(f"{cluster.PREFIX}-")]
