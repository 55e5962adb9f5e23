"""SPOOL_ENGINE=paced at small scale: the whole queue path in front of a modelled GPU (sleeping steps,
max_batch 4, more streams than slots) gives every stream exactly the paced engine's deterministic text,
the text `spool bench --mode engine` computes in-process."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from ops.harness import side_redis
from tests.conftest import MODEL, TEST_DB, running_stack
from tests.helpers import two_process_api
from tests.sse import collect
from workers.engine.paced import PacedEngine


@pytest.fixture(scope="module")
def paced_stack(tmp_path_factory):
    db = TEST_DB.rsplit("/", 1)[0] + "/spool_paced"
    env = {"SPOOL_ENGINE": "paced", "SPOOL_MAX_BATCH": "4", "SPOOL_PACED_STEP_MS": "2", "SPOOL_PACED_SEQ_MS": "0.25"}
    with running_stack(tmp_path_factory.mktemp("paced-logs"), db, side_redis("paced"), **env) as st:
        yield st


def expected_text(prompt: str, n: int, seed: int) -> str:
    """The paced engine alone, stepped in-process with no sleeping: what the stack must stream."""
    from ops.factories import params
    from workers.engine.base import SeqSpec, TokenEvent

    eng = PacedEngine(MODEL, n_ctx=1024, max_batch=4, sleep=lambda _s: None)
    eng.add(SeqSpec("k", eng.tokenize(prompt), n, params(), seed))
    ids: list[int] = []
    while eng.has_work():
        ids += [e.token_id for e in eng.step() if isinstance(e, TokenEvent) and e.token_id is not None]
    assert len(ids) == n
    return b"".join(eng.token_bytes(i) for i in ids).decode()


def _streamed_text(client: httpx.Client, body: dict) -> str:
    """The text of one streamed completion, read to its `[DONE]`."""
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **body}) as resp:
        evs, done = collect(resp)
    assert done
    return "".join(e.json["choices"][0]["text"] for e in evs if e.json["choices"])


def test_every_stream_is_the_paced_engines_text(paced_stack):
    jobs = [(f"Tell me about item {i}.", 24, i) for i in range(12)]

    def one(job):
        prompt, n, seed = job
        with paced_stack.http(paced_stack.keys["alpha"]) as http:
            return _streamed_text(http, {"prompt": prompt, "max_tokens": n, "seed": seed, "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(one, jobs))
    assert got == [expected_text(p, n, s) for p, n, s in jobs]


def test_streams_through_two_api_processes_are_the_paced_engines_text(paced_stack):
    """`spool api --workers 2`: each process has its own shared reader (core/infra/streams/read.Hub); streams on fresh
    connections land on both and every one is whole and exact."""
    with two_process_api(paced_stack) as base:
        jobs = [(f"Two processes, item {i}.", 16, 100 + i) for i in range(8)]
        headers = {"Authorization": f"Bearer {paced_stack.keys['alpha']}"}

        def one(job):
            prompt, n, seed = job
            with httpx.Client(base_url=base, headers=headers, timeout=60) as c:
                return _streamed_text(c, {"prompt": prompt, "max_tokens": n, "seed": seed})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, jobs))
        assert got == [expected_text(p, n, s) for p, n, s in jobs]


def test_the_gpu_front_table_in_one_command(paced_stack, tmp_path):
    """`python -m ops.bench.paced` at small scale: the engine alone and Spool interleaved per level,
    CPU per token of every process tree named, short JSON jobs; nothing fails."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    named = {p.pid: n for n, p in paced_stack.procs.items()}  # a worker is listed under two names
    pids = ",".join(f"{n}={pid}" for pid, n in named.items())
    out = tmp_path / "paced.json"
    env = {**paced_stack.env, "SPOOL_API_KEY": paced_stack.keys["alpha"]}
    cmd = [sys.executable, "-m", "ops.bench.paced", "--url", paced_stack.base_url, "--pids", pids]
    cmd += ["--concurrency", "1,4", "--max-tokens", "8", "--short-jobs", "16", "--json", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())
    assert [(r["kind"], r["concurrency"], r["failed"]) for r in rows] == [
        ("stream", 1, 0),
        ("stream", 4, 0),
        ("short_json", 4, 0),
    ]
    assert rows[0]["engine"].startswith("engine (paced, exact")
    assert set(rows[1]["cpu_ms_per_token"]) == {*named.values(), "client"}
    assert rows[1]["cpu_ms_per_token"]["api"] > 0 and rows[1]["ratio"] > 0
