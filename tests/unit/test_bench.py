"""spool bench's statistics and reports (pure)."""

from __future__ import annotations

import pytest

from ops.bench.client import BenchConfig, RequestResult, percentiles, plot, ratios, summarize


def test_percentiles_in_milliseconds():
    p = percentiles([0.1 * i for i in range(1, 101)])
    assert p["p50"] == 5000 or abs(p["p50"] - 5050) <= 60
    assert p["p99"] >= p["p90"] >= p["p50"]
    assert percentiles([]) == {}


def test_summary_counts_only_successes_and_ratio_against_the_engine(tmp_path):
    cfg = BenchConfig()
    ok = [RequestResult(True, ttft=0.1, itl=0.01, e2e=1.0, output_tokens=100) for _ in range(4)]
    http = summarize("spool", "http", cfg, 4, [*ok, RequestResult(False, error="HTTP 500")], 2.0)
    assert (http.requests, http.failed, http.output_tokens, http.output_tok_s) == (5, 1, 400, 200.0)
    engine = summarize("engine", "engine", cfg, 4, ok, 1.6)
    other = summarize("llama-server", "http", cfg, 4, ok, 4.0)
    got = {r["label"]: round(r["throughput_ratio"], 2) for r in ratios([http, engine, other])}
    assert got == {"spool": 0.8, "llama-server": 0.4}
    out = tmp_path / "plot.png"
    plot([http, engine, other], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompts_are_sampled_reproducibly():
    cfg = BenchConfig(requests=10, seed=3)
    assert cfg.prompts() == cfg.prompts() and len(cfg.prompts()) == 10


def test_the_yardstick_is_the_same_work_every_time_and_costs_are_given_in_its_units():
    from ops.bench import yardstick

    assert yardstick._pass() == yardstick._pass()  # fixed work: nothing in it depends on the sitting
    assert yardstick.measure(rounds=1) > 0
    # 0.15 ms per token in a sitting whose pass takes 100 ms is 1.5 thousandths of a pass: 1.5 yu;
    # the same work on a machine twice as slow costs 0.30 ms against a 200 ms pass, the same 1.5 yu.
    assert yardstick.in_units(0.15, 100.0) == pytest.approx(1.5)
    assert yardstick.in_units(0.30, 200.0) == pytest.approx(1.5)


def test_the_ceiling_bench_replays_the_captured_job_with_a_new_id_and_the_clients_tenant():
    from ops.bench.ceiling import pgbench_script

    insert = "INSERT INTO jobs (id, tenant_id, model) VALUES ('cmpl-ab12'::VARCHAR, 5::BIGINT, 'm'::VARCHAR)"
    claim = "UPDATE jobs SET state='running'::VARCHAR WHERE jobs.id = 'cmpl-ab12'::VARCHAR AND jobs.attempt = 1"
    script = pgbench_script([insert, claim], "cmpl\\-ab12", 5)
    lines = script.splitlines()
    assert lines[:3] == ["\\set n random(1, 9000000000000000000)", "\\set tenant :t0 + :client_id", "BEGIN;"]
    assert "cmpl-ab12" not in script  # every transaction a job of its own
    assert lines[3] == (
        "INSERT INTO jobs (id, tenant_id, model) VALUES (('pgb-' || :client_id || '-' || :n)::VARCHAR,"
        " :tenant::BIGINT, 'm'::VARCHAR);"
    )
    assert lines[4:] == [
        "COMMIT;",
        "BEGIN;",
        claim.replace("'cmpl-ab12'", "('pgb-' || :client_id || '-' || :n)") + ";",
        "COMMIT;",
    ]


def test_the_speculative_bench_compares_drafts_on_with_off_per_load_and_level():
    from ops.bench import speculative as spec

    for (ask, predicted), edits in zip(spec.REWRITE, spec._EDITS, strict=True):  # the input, edited as asked
        assert all(f'"{old}"' in ask and new in predicted and old not in predicted for old, new in edits)
    rows = [
        spec.Row("rewrite", 0.0, 1, "off", 100, 2.0, 0, 0, 1.6, [[1, 2, 3]]),
        spec.Row("rewrite", 0.0, 1, "auto", 100, 1.0, 60, 20, 0.4, [[1, 2, 3]]),
        spec.Row("extract", 0.8, 16, "off", 400, 4.0, 0, 0, 3.0, [[4], [5]]),
        spec.Row("extract", 0.8, 16, "auto", 400, 4.2, 0, 0, 3.2, [[4], [5]]),
        spec.Row("extract", 0.8, 16, "off again", 400, 4.1, 0, 0, 3.1, [[4], [6]]),
    ]
    got = spec.ratios(rows)
    assert got[0] == {
        "load": "rewrite",
        "temperature": 0.0,
        "concurrency": 1,
        "drafts": "auto",
        "speedup": 2.0,
        "stream_speedup": 4.0,  # the prefill, the same either way, left out
        "acceptance": 0.75,
        "same_tokens": True,
    }
    assert got[1]["speedup"] == round(100 / 105, 3) and got[1]["acceptance"] == 0.0
    # A second run without drafts is compared token for token too: its tokens differ here.
    assert got[2]["drafts"] == "off again" and got[2]["same_tokens"] is False
    assert "2.00x" in spec.table(rows) and "streamed 4.00x" in spec.table(rows)
