"""OpenAI's Files + Batches APIs against real processes and the real model."""

from __future__ import annotations

import io
import json

import pytest

from tests.conftest import MODEL, job_row, wait_for


def _lines(n: int, max_tokens: int = 4, start: int = 0, **extra) -> bytes:
    out = []
    for i in range(start, start + n):
        body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": max_tokens, "temperature": 0, **extra}
        out.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    return ("\n".join(out) + "\n").encode()


def _poll(client, batch_id: str, until: set[str], timeout: float = 180, stack=None, db=None):
    """The batch once its status is in `until`. A batch that never gets there fails with what explains
    it: its lines by state (from `db`) and the dispatcher's last log lines (its keeper, from `stack`)."""
    seen: list[str] = []

    def reached():
        b = client.batches.retrieve(batch_id)
        seen.append(b.status)
        return b if b.status in until else None

    try:
        return wait_for(reached, timeout, f"batch {batch_id} to reach {sorted(until)}", interval=0.5)
    except TimeoutError:
        why = [f"batch {batch_id} stuck in {seen[-1] if seen else None}"]
        if db is not None:
            from sqlalchemy import text

            with db.connect() as conn:
                q = "SELECT state, count(*) FROM jobs WHERE batch_id = :i GROUP BY state"
                why.append(f"lines by state: {dict(conn.execute(text(q), {'i': batch_id}).all())}")
        if stack is not None:
            why.append("dispatcher log:\n" + "\n".join(stack.log("dispatcher").splitlines()[-40:]))
        raise TimeoutError("\n".join(why)) from None


def _output(client, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


def test_openai_client_round_trip(stack):
    client = stack.openai()
    f = client.files.create(file=("in.jsonl", io.BytesIO(_lines(12))), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes > 0
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    assert f.id in [x.id for x in client.files.list().data]
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"job": "round-trip"}
    )
    assert b.status == "validating" and b.metadata == {"job": "round-trip"}
    b = _poll(client, b.id, {"completed", "failed"})
    assert b.status == "completed", b.errors
    assert b.request_counts.total == 12 and b.request_counts.completed == 12 and b.request_counts.failed == 0
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    out = _output(client, b.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(12)]  # input order, each once
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["body"]["object"] == "text_completion"
        assert o["response"]["body"]["usage"]["completion_tokens"] > 0
    assert b.error_file_id is None
    assert b.id in [x.id for x in client.batches.list().data]


def test_a_batch_shows_its_model_and_usage_and_its_files_expire_as_asked(stack):
    """Issue 51: `model`, `usage` (the sum of its lines' usage), `expires_after`, `output_expires_after`."""
    client = stack.openai()
    f = client.files.create(
        file=("two.jsonl", io.BytesIO(_lines(2))),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert f.expires_at == f.created_at + 3600
    b = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    b = _poll(client, b.id, {"completed", "failed"})
    assert b.status == "completed", b.errors
    used = [o["response"]["body"]["usage"] for o in _output(client, b.output_file_id)]
    assert b.model == MODEL and b.usage is not None and len(used) == 2
    assert b.usage.input_tokens == sum(u["prompt_tokens"] for u in used) > 0
    assert b.usage.output_tokens == sum(u["completion_tokens"] for u in used) > 0
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in used)
    assert b.usage.input_tokens_details.cached_tokens == cached
    assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens
    out = client.files.retrieve(b.output_file_id)
    assert out.expires_at == out.created_at + 7200


def test_validation_reports_every_bad_line_and_runs_nothing(stack, db):
    client = stack.openai()
    good = _lines(3).decode().splitlines()
    bad = [
        good[0],
        "{not json",
        json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}),
        json.dumps(
            {
                "custom_id": "y",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": "p", "temperature": 9},
            }
        ),
        good[0],  # duplicate custom_id req-0
        json.dumps(
            {"custom_id": "z", "method": "POST", "url": "/v1/completions", "body": {"model": "nope", "prompt": "p"}}
        ),
        good[1],
    ]
    f = client.files.create(file=("bad.jsonl", io.BytesIO(("\n".join(bad) + "\n").encode())), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    b = _poll(client, b.id, {"failed", "completed", "in_progress"})
    assert b.status == "failed"
    errs = {e.line: e for e in b.errors.data}
    assert sorted(errs) == [2, 3, 4, 5, 6]
    assert errs[2].code == "invalid_json_line" and errs[3].code == "mismatched_url"
    assert errs[4].param == "body.temperature" and errs[5].code == "duplicate_custom_id"
    assert errs[6].code == "model_not_found"
    with db.connect() as conn:
        from sqlalchemy import text

        assert conn.scalar(text("SELECT count(*) FROM jobs WHERE batch_id = :b"), {"b": b.id}) == 0


def test_cancel_stops_queued_lines_and_lets_running_ones_end(stack):
    client = stack.openai()
    f = client.files.create(
        file=("many.jsonl", io.BytesIO(_lines(150, max_tokens=24, ignore_eos=True))), purpose="batch"
    )
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 3, 120, "some lines done")
    assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
    b = _poll(client, b.id, {"cancelled"})
    done, failed = b.request_counts.completed, b.request_counts.failed
    assert done + failed == 150 and 3 <= done < 150
    out, err = _output(client, b.output_file_id), _output(client, b.error_file_id)
    assert len(out) == done and len(err) == failed
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    ids = [o["custom_id"] for o in out + err]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(150))


def test_expiry_returns_what_finished_and_expires_the_rest(stack):
    client = stack.openai()
    f = client.files.create(
        file=("slow.jsonl", io.BytesIO(_lines(150, max_tokens=24, ignore_eos=True))), purpose="batch"
    )
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="4s")
    b = _poll(client, b.id, {"expired", "completed"})
    assert b.status == "expired" and b.expired_at
    out, err = _output(client, b.output_file_id), _output(client, b.error_file_id)
    assert out and err and len(out) + len(err) == 150
    assert {e["error"]["code"] for e in err} == {"batch_expired"}
    assert sorted(o["custom_id"] for o in out + err) == sorted(f"req-{i}" for i in range(150))


def test_killing_worker_and_dispatcher_loses_and_duplicates_nothing(stack, db):
    client = stack.openai()
    n = 30  # the kill lands after 5 lines: 25 still to run, some of them mid-generation
    f = client.files.create(
        file=("crash.jsonl", io.BytesIO(_lines(n, max_tokens=30, ignore_eos=True))), purpose="batch"
    )
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 5, 120, "progress")
    stack.kill_worker()
    disp = stack.procs.pop("dispatcher")
    disp.kill()
    disp.wait(10)
    stack.start("dispatcher", "dispatcher")
    stack.start_worker()
    b = _poll(client, b.id, {"completed", "failed"}, timeout=300)
    assert b.status == "completed" and b.request_counts.completed == n
    out = _output(client, b.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(n)]
    resumed = 0
    for o in out:
        job = job_row(db, o["response"]["request_id"])
        assert job["usage"]["completion_tokens"] == 30
        resumed += job["attempt"] > 1
    assert resumed, "the kill hit no running line: nothing was resumed"
    # Every line, resumed or not, has exactly the text an undisturbed greedy run gives.
    from concurrent.futures import ThreadPoolExecutor

    def undisturbed(i: int) -> str:
        body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        with stack.http(stack.keys["alpha"]) as http:
            return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(undisturbed, range(n)))
    assert [o["response"]["body"]["choices"][0]["text"] for o in out] == expected


def test_file_errors_and_isolation(stack):
    import openai

    client = stack.openai()
    other = stack.openai("beta")
    f = client.files.create(file=("in.jsonl", io.BytesIO(_lines(1))), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"x")), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    for call in (
        lambda: other.files.retrieve(f.id),
        lambda: other.files.content(f.id),
        lambda: other.files.delete(f.id),
        lambda: other.batches.retrieve(b.id),
        lambda: other.batches.cancel(b.id),
        lambda: other.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in other.files.list().data]
    assert b.id not in [x.id for x in other.batches.list().data]
    _poll(client, b.id, {"completed"})
    assert client.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_killing_the_validator_mid_validation_loses_nothing(stack, db):
    """Validation runs in the dispatcher process (never the API); killing it mid-file commits nothing,
    and the batch is taken over when its validation lease lapses."""
    from sqlalchemy import text

    client = stack.openai()
    n = 20_000  # validation takes a few seconds: long enough to kill the validator in the middle
    f = client.files.create(file=("big.jsonl", io.BytesIO(_lines(n, max_tokens=1))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")

    def claimed() -> bool:
        with db.connect() as conn:
            row = conn.execute(text("SELECT status, lease_until FROM batches WHERE id = :i"), {"i": b.id}).one()
        return row.status == "validating" and row.lease_until is not None

    def copying() -> bool:  # its lines are going into the staging table: validation is under way
        q = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'active' AND query LIKE 'COPY batch_staging%'"
        )
        with db.connect() as conn:
            return bool(conn.scalar(text(q)))

    wait_for(claimed, 30, "the validator to claim the batch", interval=0.05)
    wait_for(copying, 30, "the validator to be mid-file", interval=0.05)
    dispatcher = stack.procs.pop("dispatcher")
    dispatcher.kill()  # mid-validation: its transaction never commits
    dispatcher.wait(10)
    with db.connect() as conn:  # it really was in the middle: still validating, and no line stored yet
        assert conn.scalar(text("SELECT status FROM batches WHERE id = :i"), {"i": b.id}) == "validating"
        assert conn.scalar(text("SELECT count(*) FROM jobs WHERE batch_id = :i"), {"i": b.id}) == 0
    stack.start("dispatcher", "dispatcher")
    b = _poll(client, b.id, {"in_progress", "failed", "completed"}, timeout=120, stack=stack, db=db)
    assert b.status == "in_progress" and b.request_counts.total == n
    client.batches.cancel(b.id)  # the lines themselves are not the point here
    b = _poll(client, b.id, {"cancelled"}, timeout=120, stack=stack, db=db)
    out, err = _output(client, b.output_file_id), _output(client, b.error_file_id)
    ids = [o["custom_id"] for o in out + err]
    assert len(ids) == n and len(set(ids)) == n  # every line exactly once


def test_cli_submit_wait_and_results(stack, tmp_path):
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    src.write_bytes(_lines(5, max_tokens=2))
    out = tmp_path / "out.jsonl"
    env = {**stack.env, "SPOOL_URL": stack.base_url, "SPOOL_API_KEY": stack.keys["alpha"]}
    run = subprocess.run(
        [sys.executable, "-m", "core.cli", "batch", "submit", str(src), "--wait", "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    batch_id = run.stdout.splitlines()[0]
    assert "completed" in run.stdout
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == [f"req-{i}" for i in range(5)]
    again = tmp_path / "again.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "core.cli", "batch", "results", batch_id, "-o", str(again)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and again.read_text() == out.read_text()
