"""Fault injection: a whole Spool on a Postgres and a Redis of its own, killed and restarted under
load, then audited against the ledger.

    python -m ops.faults                 # the full run (20 worker kills, every other fault once)
    python -m ops.faults --short         # what CI runs (tests/e2e/test_faults.py)
    python -m ops.faults --json out.json # the report as JSON too

Load while the faults happen: streaming greedy completions (clients re-attach with `Last-Event-ID`
when the API goes away, and retry a POST that got no answer with the same `Idempotency-Key`),
`Prefer: respond-async` jobs polled to the end, one Batches API batch, and the official `openai` SDK
as its users run it (completions and chat, streamed and not; its own retries, one `Idempotency-Key`
per request, a stream cut by an API restart asked again with that key; and `background: true`
responses of the Responses API, created under one key and polled with `retrieve` until they end,
audited against an undisturbed response), and bursts of keyless
completions (no `Idempotency-Key`, as most clients send them; the API stores a burst's jobs together,
core/jobs/submit.Submitter): each tagged by its `user`, so the audit finds every job a request
stored: a 503 must have stored none, and one request never stores two. Faults, one after another
with load in between: worker SIGKILL mid-generation (a new worker is started each time), Redis
SIGKILLed and restarted *empty*, Postgres stopped hard (`-m immediate`) and restarted, the API
SIGTERMed and SIGKILLed mid-stream, the dispatcher SIGKILLed; the full run adds Redis and Postgres
away for 30 s each (longer than the API's key cache and redis-py's retries), and Redis up but refusing
every write for 30 s (`OOM` under maxmemory, `MISCONF` after a failed snapshot).

The report counts, per request a client made: **lost** (never finished, or ended other than
succeeded), **duplicated** (more than one job, or a batch line answered twice), **wrong** (a text
other than an undisturbed run's: greedy requests must match exactly), **stuck** (not terminal when
the load is over), **5xx** (any 5xx except the 503 with `Retry-After` that the API answers, storing
nothing, while Postgres is down; those are counted apart as refusals the clients retried).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import httpx2  # the openai SDK's HTTP client (its fork of httpx)
import openai

from ops import history
from ops.harness import Stack, events, free_port, refuse_writes
from ops.harness import wait_for as _wait_for

MODEL = "smollm2-135m-instruct"
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
LONG_OUTAGE_S = 30.0  # past the API's 5 s key cache and redis-py's retry window
SDK_KINDS = ("sdk-completion", "sdk-completion-stream", "sdk-chat", "sdk-chat-stream", "sdk-response-bg")
# A background response's statuses once it has ended (`incomplete`: it reached `max_output_tokens`).
RESPONSE_ENDED = {"completed", "incomplete", "failed", "cancelled"}
KEYLESS_BURST = 6  # keyless requests a client sends at once


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """ops/harness.py's wait; here a service being killed or restarted may raise anything meanwhile."""
    return _wait_for(predicate, timeout, what, interval, tolerate=(Exception,))


def _can_connect(port: int) -> bool:
    socket.create_connection(("127.0.0.1", port), 1).close()
    return True


# -- the services it may kill -------------------------------------------------------------------------
class OwnPostgres:
    """A throwaway cluster (initdb) on a free port, local trust auth, data in the work folder."""

    def __init__(self, workdir: Path) -> None:
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
        if not versions:
            raise SystemExit("ops.faults needs PostgreSQL's server binaries (Debian: postgresql)")
        self.bin = versions[-1].parent
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        # As root the cluster runs as `postgres`, which must reach its folder: a pytest tmp dir (0700,
        # root's) would not do, so it gets a fresh folder of its own under the system temp dir.
        base = Path(tempfile.mkdtemp(prefix="spool-faults-pg-")) if self.as_user else workdir
        self.port, self.data = free_port(), base / "pg"
        self.listen = "127.0.0.1"  # more addresses (comma-separated) for clients on other hosts (netns)
        self.wrap: list[str] = []  # a prefix for its commands: `ip netns exec NS` runs it on another "host"
        self.trusted: list[str] = []  # networks (CIDR) whose clients may log in too, by trust as the rest

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/spool"

    def _run(self, *argv: str) -> None:
        subprocess.run([*self.wrap, *self.as_user, *argv], check=True, capture_output=True)

    def init(self) -> None:
        self.data.mkdir(parents=True)
        if self.as_user:
            self.data.parent.chmod(0o755)
            shutil.chown(self.data.parent, "postgres")
            shutil.chown(self.data, "postgres")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.writelines(f"host all all {cidr} trust\n" for cidr in self.trusted)
        self.start()
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "spool")

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.data} -c listen_addresses={self.listen} -c max_connections=300"
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.data / "log"), "-w", "start"
        )

    def remove(self) -> None:
        if self.as_user:
            shutil.rmtree(self.data.parent, ignore_errors=True)

    def stop(self, mode: str = "fast") -> None:
        subprocess.run(
            [*self.wrap, *self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
            capture_output=True,
        )


class OwnRedis:
    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def snapshots(self) -> Path:
        return self.workdir / "snapshots"

    def start(self) -> None:
        self.snapshots.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
                *("--dir", str(self.snapshots)),  # set at start: `dir` is a protected setting at runtime
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
        )
        wait_for(lambda: _can_connect(self.port), 10, "redis")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def refuse_writes(self, how: str, seconds: float) -> None:
        """Redis stays up but refuses writes for `seconds`: `oom` (maxmemory 1 with noeviction, as
        compose's Redis when full) or `misconf` (a snapshot that cannot be written: MISCONF)."""
        import redis as redis_lib

        r = redis_lib.Redis(port=self.port)
        lift = refuse_writes(r, how, self.snapshots)
        time.sleep(seconds)
        lift()
        r.close()


# The harnesses' timings (this one's and ops/cluster.py's): recovery paths run in seconds.
TIMINGS = {
    "SPOOL_LEASE_S": "3",
    "SPOOL_DISPATCH_TIMEOUT_S": "8",
    "SPOOL_DISPATCHER_INTERVAL_S": "0.5",
    "SPOOL_INFRA_RETRY_S": "120",
    "SPOOL_N_CTX": "1024",
    "SPOOL_BATCH_VALIDATION_LEASE_S": "5",
    "SPOOL_MAX_ATTEMPTS": "50",  # 20+ kills: a job may be hit several times
    "PYTHONUNBUFFERED": "1",
}


def _stack(workdir: Path, db_url: str, redis_url: str) -> Stack:
    """Spool's own processes (ops/harness.Stack, as the tests drive them), logs in the work folder."""
    port = free_port()
    env = {
        **os.environ,
        "SPOOL_DATABASE_URL": db_url,
        "SPOOL_REDIS_URL": redis_url,
        "SPOOL_API_PORT": str(port),
        **TIMINGS,
    }
    return Stack(env=env, logdir=workdir, port=port, worker_metrics=False)


# -- the clients -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str  # stream | async | batch
    prompt: str
    job_id: str | None = None
    text: str | None = None
    status: str | None = None  # the job's final status as the client saw it
    reattached: int = 0
    retried_posts: int = 0
    # A keyless request's tags (its `user`), one per POST: refused ones (503) must have stored nothing,
    # cut ones (the connection broke) may have stored a job, which must still end.
    refused: list[str] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)
    # A streamed request's events, each with the connection it came on (ops/history.py checks them).
    events: list[history.Seen] = field(default_factory=list)
    conns: int = 0  # connections opened so far


def from_balancer(r: httpx.Response | httpx2.Response) -> bool:
    """An error page of the load balancer in front (ops/cluster.py's HAProxy): a backend that died
    before it answered. Spool's own errors are JSON."""
    return r.status_code in (502, 503, 504) and r.headers.get("content-type", "").startswith("text/html")


@dataclass
class Tally:
    http_5xx: int = 0
    http_503: int = 0
    balancer: int = 0  # the balancer's own 502/503/504 (no backend answered): counted apart, retried
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def saw(self, r: httpx.Response | httpx2.Response) -> None:
        if r.status_code >= 500:
            with self.lock:
                if from_balancer(r):
                    self.balancer += 1
                elif r.status_code == 503 and "retry-after" in r.headers:
                    self.http_503 += 1
                else:
                    self.http_5xx += 1
                    self.errors.append(f"{r.status_code} {r.request.method} {r.request.url.path}: {r.text[:200]}")


RETRYABLE = (httpx.TransportError,)


def _body(prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


class Client:
    def __init__(self, url: str, key: str, tally: Tally, give_up_s: float = 300) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        self.tally, self.give_up_s = tally, give_up_s
        self.line_jobs: dict[str, str] = {}  # a batch line's custom_id -> its job, for the report

    def _post(self, path: str, out: Outcome, **kw: Any) -> httpx.Response:
        """POST with one Idempotency-Key, retried on connection errors, 503s and 409s until answered,
        as the `openai` SDK does. A 409 is the same key still in progress: an API killed between
        taking the key and storing the job leaves it so until the key is stale and taken over."""
        headers = {"Idempotency-Key": uuid.uuid4().hex, **kw.pop("headers", {})}
        deadline = time.monotonic() + self.give_up_s
        while True:
            try:
                r = self.http.post(path, headers=headers, **kw)
                self.tally.saw(r)
                if r.status_code not in (409, 503, 502, 504) or time.monotonic() > deadline:
                    return r
            except RETRYABLE:
                if time.monotonic() > deadline:
                    raise
            out.retried_posts += 1
            time.sleep(1.0)

    def stream(self, prompt: str, max_tokens: int) -> Outcome:
        """A streaming completion that survives the API going away: re-attach with Last-Event-ID."""
        out = Outcome("stream", prompt)
        key = uuid.uuid4().hex
        text, last_id = "", None
        deadline = time.monotonic() + self.give_up_s
        while time.monotonic() < deadline:
            try:
                if out.job_id is None:  # no chunk yet: (re)send the POST; the key re-attaches from the start
                    text, last_id = "", None
                    ctx = self.http.stream(
                        "POST",
                        "/v1/completions",
                        json=_body(prompt, max_tokens, stream=True),
                        headers={"Idempotency-Key": key},
                    )
                else:
                    out.reattached += 1
                    headers: dict[str, str] = {"Last-Event-ID": last_id} if last_id else {}
                    ctx = self.http.stream("GET", f"/v1/jobs/{out.job_id}/events", headers=headers)
                with ctx as resp:
                    if resp.status_code != 200:
                        resp.read()
                        self.tally.saw(resp)
                        if out.job_id is None:
                            out.retried_posts += 1
                        time.sleep(1.0)
                        continue
                    conn = out.conns
                    out.conns += 1
                    if out.job_id is None:  # a POST again: nothing of an earlier try was kept
                        out.events.clear()
                    for ev in events(resp):
                        ev_id, data = ev.id, ev.data
                        if data == "[DONE]":
                            out.text = text
                            return self._finish(out)
                        chunk = json.loads(data)
                        if "error" in chunk:
                            out.status = "error:" + str(chunk["error"].get("code"))
                            return out
                        out.job_id = chunk["id"]
                        last_id = ev_id or last_id
                        delta = "".join(c.get("text", "") for c in chunk.get("choices", []))
                        out.events.append(history.Seen(conn, ev_id, delta))
                        text += delta
            except RETRYABLE:
                pass
            time.sleep(0.5)  # the API is restarting: try again
        return out

    def _finish(self, out: Outcome) -> Outcome:
        job = self._get_job(out.job_id or "")
        out.status = job.get("status") if job else None
        return out

    def _get_job(self, job_id: str) -> dict | None:
        deadline = time.monotonic() + self.give_up_s
        while time.monotonic() < deadline:
            try:
                r = self.http.get(f"/v1/jobs/{job_id}")
                self.tally.saw(r)
                if r.status_code == 200:
                    return r.json()
            except RETRYABLE:
                pass
            time.sleep(1.0)
        return None

    def async_job(self, prompt: str, max_tokens: int) -> Outcome:
        out = Outcome("async", prompt)
        r = self._post("/v1/completions", out, json=_body(prompt, max_tokens), headers={"Prefer": "respond-async"})
        if r.status_code not in (200, 202):
            out.status = f"http {r.status_code}"
            return out
        out.job_id = r.json()["id"]
        return self._read_job(out)

    def keyless(self, prompt: str, max_tokens: int) -> Outcome:
        """A completion without an Idempotency-Key, waited for, as most OpenAI clients send one: the
        API's group commit stores these. A 503 with Retry-After stored nothing, so the client sends the
        same request again; a broken connection leaves it not knowing, so it sends a new one (a new
        tag) and the broken one's job, if it was stored, must end all the same."""
        out = Outcome("keyless", prompt)
        deadline = time.monotonic() + self.give_up_s
        while time.monotonic() < deadline:
            tag = "keyless-" + uuid.uuid4().hex
            try:
                r = self.http.post("/v1/completions", json=_body(prompt, max_tokens, user=tag))
                self.tally.saw(r)
            except RETRYABLE:
                out.cut.append(tag)
                time.sleep(0.5)
                continue
            if from_balancer(r):  # the API behind it died before answering: as a broken connection
                out.cut.append(tag)
                time.sleep(0.5)
                continue
            if r.status_code == 503 and r.headers.get("x-spool-job-id"):
                # The API restarted under the wait: the job was stored and goes on. Without a key, read
                # it where the answer says rather than send the request again.
                out.job_id = r.headers["x-spool-job-id"]
                return self._read_job(out)
            if r.status_code == 503 and "retry-after" in r.headers:
                out.refused.append(tag)
                out.retried_posts += 1
                time.sleep(1.0)
                continue
            if r.status_code != 200:
                out.status = f"http {r.status_code}"
                return out
            body = r.json()
            out.job_id, out.text = body["id"], body["choices"][0]["text"]
            out.status = "succeeded"
            return out
        return out

    def _read_job(self, out: Outcome) -> Outcome:
        """Poll `out.job_id` until it ends; its status and text into `out`."""
        deadline = time.monotonic() + self.give_up_s
        while time.monotonic() < deadline:
            job = self._get_job(out.job_id or "")
            if job and job["status"] in TERMINAL:
                out.status = job["status"]
                if job.get("result"):
                    out.text = job["result"]["choices"][0]["text"]
                return out
            time.sleep(0.5)
        return out

    def batch(self, prompts: list[str], max_tokens: int) -> tuple[str | None, dict[str, list[str | None]]]:
        """Submit a batch of greedy lines; returns (batch id, custom_id -> every text the output held)."""
        lines = [
            json.dumps(
                {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": _body(p, max_tokens)}
            )
            for i, p in enumerate(prompts)
        ]
        out = Outcome("batch", "")
        f = self._post(
            "/v1/files",
            out,
            files={"file": ("faults.jsonl", ("\n".join(lines) + "\n").encode())},
            data={"purpose": "batch"},
        )
        b = self._post(
            "/v1/batches",
            out,
            json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
        )
        batch_id = b.json()["id"]
        deadline = time.monotonic() + self.give_up_s * 2
        body: dict | None = None
        while time.monotonic() < deadline:
            try:
                r = self.http.get(f"/v1/batches/{batch_id}")
                self.tally.saw(r)
                if r.status_code == 200 and r.json()["status"] in ("completed", "failed", "expired", "cancelled"):
                    body = r.json()
                    break
            except RETRYABLE:
                pass
            time.sleep(1.0)
        texts: dict[str, list[str | None]] = {}
        if body and body.get("output_file_id"):
            content = self.http.get(f"/v1/files/{body['output_file_id']}/content")
            self.tally.saw(content)
            for line in content.text.splitlines():
                row = json.loads(line)
                choice = row["response"]["body"]["choices"][0] if row.get("response") else {"text": None}
                texts.setdefault(row["custom_id"], []).append(choice["text"])
                if row.get("response"):
                    self.line_jobs[row["custom_id"]] = row["response"]["body"].get("id", "")
        return batch_id, texts


class SdkClient:
    """The official `openai` SDK, used as its users use it: its own retries (503 + Retry-After, 409,
    connection errors) under one `Idempotency-Key` per request. A stream that breaks mid-way (the API
    was killed) is asked again with the same key, which replays the job's stream from its start: the
    SDK has no Last-Event-ID, so that is what an SDK user can do."""

    def __init__(self, url: str, key: str, tally: Tally, give_up_s: float = 300) -> None:
        self.tally, self.give_up_s, self.posts = tally, give_up_s, 0
        self.http = httpx2.Client(timeout=120, event_hooks={"response": [self._saw]})
        self.sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=100, http_client=self.http)
        self.jobs = Client(url, key, tally, give_up_s)  # the job's final state, as the ledger has it

    def _saw(self, r: httpx2.Response) -> None:
        if r.request.method == "POST":
            self.posts += 1
        if r.status_code >= 500:
            r.read()  # a streamed response's body is not read yet; the tally quotes it
        self.tally.saw(r)

    def response(self, prompt: str, max_tokens: int) -> Outcome:
        """A background response (`background: true`), as the Responses API's users run one: created
        under one `Idempotency-Key` (the SDK retries the POST with it), then polled with `retrieve`
        until it ends, through whatever the API, Redis or Postgres do meanwhile."""
        out = Outcome("sdk-response-bg", prompt)
        key = uuid.uuid4().hex
        self.posts = 0
        deadline = time.monotonic() + self.give_up_s
        resp_id = None
        while resp_id is None and time.monotonic() < deadline:
            try:
                r = self.sdk.responses.create(
                    model=MODEL,
                    input=prompt,
                    background=True,
                    max_output_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                    extra_headers={"Idempotency-Key": key},
                )
                resp_id = r.id
            except openai.APIConnectionError:
                time.sleep(1.0)  # its retries used up while the API was away: the same key again
            except openai.APIStatusError as e:
                out.status = f"http {e.status_code}"
                return out
        out.retried_posts = max(0, self.posts - 1)
        if resp_id is None:
            return out
        out.job_id = "cmpl-" + resp_id.removeprefix("resp_")
        while time.monotonic() < deadline:
            try:
                got = self.sdk.responses.retrieve(resp_id)
            except openai.APIConnectionError:
                time.sleep(1.0)
                continue
            except openai.APIStatusError as e:
                out.status = f"http {e.status_code} polling"
                return out
            if got.status in RESPONSE_ENDED:
                if got.status in ("completed", "incomplete"):
                    out.text = got.output_text
                    return self.jobs._finish(out)
                out.status = f"response {got.status}"
                return out
            time.sleep(0.5)
        return out

    def run(self, kind: str, prompt: str, max_tokens: int) -> Outcome:
        if kind == "sdk-response-bg":
            return self.response(prompt, max_tokens)
        out = Outcome(kind, prompt)
        chat, stream = "chat" in kind, kind.endswith("stream")
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        common: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
            "extra_headers": headers,
        }
        self.posts = 0
        deadline = time.monotonic() + self.give_up_s
        while out.text is None and time.monotonic() < deadline:
            try:
                if chat:
                    messages: Any = [{"role": "user", "content": prompt}]
                    if stream:
                        pieces, conn = [], out.conns
                        out.conns += 1
                        for chunk in self.sdk.chat.completions.create(messages=messages, stream=True, **common):
                            out.job_id = chunk.id
                            pieces += [c.delta.content or "" for c in chunk.choices]
                            out.events.append(
                                history.Seen(conn, None, "".join(c.delta.content or "" for c in chunk.choices))
                            )
                        out.text = "".join(pieces)
                    else:
                        resp = self.sdk.chat.completions.create(messages=messages, **common)
                        out.job_id, out.text = resp.id, resp.choices[0].message.content or ""
                elif stream:
                    pieces, conn = [], out.conns
                    out.conns += 1
                    for part in self.sdk.completions.create(prompt=prompt, stream=True, **common):
                        out.job_id = part.id
                        pieces += [c.text for c in part.choices]
                        out.events.append(history.Seen(conn, None, "".join(c.text for c in part.choices)))
                    out.text = "".join(pieces)
                else:
                    done = self.sdk.completions.create(prompt=prompt, **common)
                    out.job_id, out.text = done.id, done.choices[0].text
            except openai.APIConnectionError:
                # The API went away: its retries used up, or mid-stream (the SDK never retries those).
                out.reattached += 1 if out.job_id else 0
                time.sleep(1.0)
            except openai.APIStatusError as e:
                out.status = f"http {e.status_code}"
                return out
            except Exception as e:  # what a user's program would crash on: counted as lost, named
                out.status = f"sdk raised {type(e).__name__}: {str(e)[:200]}"
                return out
        out.retried_posts = max(0, self.posts - 1)
        return self.jobs._finish(out) if out.text is not None else out


# -- the run -----------------------------------------------------------------------------------------
@dataclass
class Report:
    requests: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    stuck: int = 0
    http_5xx: int = 0
    http_503_refusals_retried: int = 0
    balancer_errors: int = 0  # the load balancer's own error pages (ops/cluster.py), retried by clients
    batch_lines: int = 0
    reattached_streams: int = 0
    resumed_jobs: int = 0  # jobs that ran more than one attempt
    keyless_orphans: int = 0  # keyless requests cut off after their job was stored (it ran; nobody read it)
    # Every streamed request's events, connection by connection (ops/history.py): checked, and how
    # many repeated or skipped text at a resume point.
    streams_checked: int = 0
    stream_events: int = 0
    stream_connections: int = 0
    repeated_events: int = 0
    skipped_events: int = 0
    by_client: dict[str, int] = field(default_factory=dict)  # requests per kind of client
    faults: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.wrong
            or self.stuck
            or self.http_5xx
            or self.repeated_events
            or self.skipped_events
        )


def run(
    short: bool,
    worker_kills: int | None = None,
    workdir: Path | None = None,
    seed: int = 7,
    only: set[str] | None = None,
    rounds: int = 1,
) -> Report:
    rng = random.Random(seed)
    started = time.monotonic()
    workdir = workdir or Path(tempfile.mkdtemp(prefix="spool-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)  # logs and Redis's folder (Postgres may live elsewhere)
    print(f"logs and data in {workdir}", flush=True)
    pg, rd = OwnPostgres(workdir), OwnRedis(workdir)
    pg.init()
    rd.start()
    st = _stack(workdir, pg.url, rd.url)
    report = Report()
    try:
        st.cli("migrate")
        st.cli("tenant", "create", "faults")
        key = st.cli("key", "create", "--tenant", "faults").splitlines()[-1]
        st.start_api()
        st.start("dispatcher", "dispatcher")
        st.start_worker()
        wait_for(st.ready, 60, "ready")
        report = _load_and_faults(st, pg, rd, key, rng, short, worker_kills, report, only, rounds)
    finally:
        st.stop_all()
        rd.kill()
        pg.stop("immediate")
        pg.remove()
    report.seconds = round(time.monotonic() - started, 1)
    return report


N_TOKENS = 40  # every client request's length (greedy, ignore_eos)


def load_and_audit(
    base_url: str,
    key: str,
    db_url: str,
    rng: random.Random,
    short: bool,
    report: Report,
    inject: Callable[[], None],
    history_path: Path | None = None,
) -> Report:
    """The harness's clients against `base_url` while `inject()` runs the faults; then every client's
    outcome audited against the ledger at `db_url` (lost, duplicated, wrong, stuck, 5xx) and every
    stream's events against the undisturbed text (ops/history.py; written to `history_path`) into
    `report`. The fault harness (one host) and the cluster harness (ops/cluster.py) share it."""
    tally = Tally()
    n_tokens = N_TOKENS
    prompts = [f"Fault test {i}: once upon a time" for i in range(12)]
    # What an undisturbed run answers: greedy, so every disturbed run must give exactly this. The 36
    # reference requests go at once, so the engine decodes them together (one after another they took
    # a quarter of a short run); the load's own requests are batched with each other just the same.
    ref_client = Client(base_url, key, tally)
    # Each waits for its whole answer, and the last of them for the batches before it: on a slow stretch
    # of a shared 2-core machine (four engines on it, a fixed CPU workload 3x its quick time) the last
    # took over the clients' 60 s read timeout (2026-11-28, twice). Nothing is being faulted yet.
    ref_client.http.timeout = httpx.Timeout(60, read=ref_client.give_up_s)

    def answer(kind: str, p: str) -> str:
        if kind == "completion":
            r = ref_client.http.post("/v1/completions", json=_body(p, n_tokens))
            r.raise_for_status()
            return str(r.json()["choices"][0]["text"])
        if kind == "chat":
            chat = {k: v for k, v in _body(p, n_tokens).items() if k != "prompt"}
            r = ref_client.http.post(
                "/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": p}]}
            )
            r.raise_for_status()
            return str(r.json()["choices"][0]["message"]["content"])
        body = {"model": MODEL, "input": p, "max_output_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
        r = ref_client.http.post("/v1/responses", json=body)
        r.raise_for_status()
        return "".join(
            part["text"] for item in r.json()["output"] if item["type"] == "message" for part in item["content"]
        )

    asked = [(kind, p) for kind in ("completion", "chat", "response") for p in prompts]
    with ThreadPoolExecutor(len(asked)) as pool:
        answers = dict(zip(asked, pool.map(lambda a: answer(*a), asked), strict=True))
    references = {kind: {p: answers[kind, p] for p in prompts} for kind in ("completion", "chat", "response")}
    reference = references["completion"]
    reference_jobs = 3 * len(prompts)

    def expected_of(kind: str) -> dict[str, str]:
        return history.reference_for(references, kind)

    stop = threading.Event()
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def loop(kind: str) -> None:
        c, sdk = Client(base_url, key, tally), SdkClient(base_url, key, tally)
        while not stop.is_set():
            p = rng.choice(prompts)
            if kind == "keyless":  # a burst at once, so that the API stores them together
                with ThreadPoolExecutor(KEYLESS_BURST) as pool:
                    got = list(pool.map(lambda q: c.keyless(q, n_tokens), rng.sample(prompts, KEYLESS_BURST)))
                with lock:
                    outcomes.extend(got)
                continue
            if kind in SDK_KINDS:
                o = sdk.run(kind, p, n_tokens)
            else:
                o = c.stream(p, n_tokens) if kind == "stream" else c.async_job(p, n_tokens)
            with lock:
                outcomes.append(o)

    batch_result: dict[str, Any] = {}
    batch_prompts = [prompts[i % len(prompts)] for i in range(24 if short else 60)]

    def batch() -> None:
        c = Client(base_url, key, tally)
        batch_result["id"], batch_result["texts"] = c.batch(batch_prompts, n_tokens)
        batch_result["jobs"] = c.line_jobs

    threads = [
        threading.Thread(target=loop, args=(k,), daemon=True)
        for k in ["stream"] * 4 + ["async"] * 2 + ["keyless"] + list(SDK_KINDS)
    ]
    threads.append(threading.Thread(target=batch, daemon=True))
    for t in threads:
        t.start()

    from sqlalchemy import create_engine, text

    try:
        inject()
    finally:  # a fault that raised must not leave the clients running after the stack is gone
        stop.set()
    for t in threads:
        t.join(timeout=900)

    # -- the audit: what the clients saw, against the ledger ---------------------------------------
    db = create_engine(db_url, pool_pre_ping=True)
    with db.connect() as conn:
        rows = conn.execute(text('SELECT id, state, attempt, kind, "user" FROM jobs')).all()
    by_id = {r.id: r for r in rows}
    # Keyless requests are audited by their tags below; the key-based count of duplicates leaves them out.
    keyless_jobs: dict[str, list[Any]] = {}
    for job in rows:
        if (job.user or "").startswith("keyless-"):
            keyless_jobs.setdefault(job.user, []).append(job)
    interactive = [r for r in rows if r.kind == "interactive" and not (r.user or "").startswith("keyless-")]
    report.resumed_jobs = sum(1 for r in rows if r.attempt > 1)
    report.stuck = sum(1 for r in rows if r.state not in TERMINAL)
    client_jobs = [o for o in outcomes if o.job_id and o.kind != "keyless"]
    for o in outcomes:
        if o.kind != "keyless":
            continue
        for tag in o.refused:  # a refusal stores nothing: its retry would otherwise run the request twice
            if keyless_jobs.get(tag):
                report.duplicated += 1
                report.problems.append(f"keyless {tag}: refused with a 503, yet stored {len(keyless_jobs[tag])} job(s)")
        report.keyless_orphans += sum(1 for tag in o.cut if keyless_jobs.get(tag))
    for tag, found in keyless_jobs.items():
        if len(found) > 1:
            report.duplicated += len(found) - 1
            report.problems.append(f"keyless {tag}: one request, {len(found)} jobs")
    report.requests = len(outcomes) + reference_jobs
    # Each keyed client request carries one Idempotency-Key: any extra interactive job is a duplicate
    # (added to the keyless duplicates counted above).
    report.duplicated += max(0, len(interactive) - reference_jobs - len({o.job_id for o in client_jobs}))
    report.reattached_streams = sum(1 for o in outcomes if o.reattached)
    for o in outcomes:
        report.by_client[o.kind] = report.by_client.get(o.kind, 0) + 1
    for o in outcomes:
        row = by_id.get(o.job_id or "")
        if o.status != "succeeded" or row is None or row.state != "succeeded":
            report.lost += 1
            report.problems.append(f"{o.kind} {o.job_id}: client saw {o.status}, ledger {row.state if row else None}")
        elif o.text != (expected := expected_of(o.kind)[o.prompt]):
            report.wrong += 1
            report.problems.append(
                f"{o.kind} {o.job_id}: text differs from the undisturbed run's (re-attached {o.reattached}x, "
                f"POST retried {o.retried_posts}x): got {o.text!r}, expected {expected!r}"
            )
    # Inside each stream: at every connection, what the client had so far must begin the reference.
    seen = history.Verdict()
    for o in outcomes:
        history.check(o.kind, f"{o.kind} {o.job_id}", o.events, expected_of(o.kind)[o.prompt], seen)
    report.streams_checked, report.stream_events, report.stream_connections = (
        seen.histories,
        seen.events,
        seen.connections,
    )
    report.repeated_events, report.skipped_events = seen.repeated, seen.skipped
    report.problems += seen.problems
    if history_path is not None:
        records = (history.Record(o.kind, o.prompt, o.job_id, o.status, o.events) for o in outcomes)
        history.write(history_path, references, records)
    texts = batch_result.get("texts", {})
    report.batch_lines = len(batch_prompts)
    for i, p in enumerate(batch_prompts):
        got = texts.get(f"line-{i}", [])
        if len(got) == 0:
            report.lost += 1
            report.problems.append(f"batch line-{i}: missing from the output")
        elif len(got) > 1:
            report.duplicated += 1
            report.problems.append(f"batch line-{i}: {len(got)} times in the output")
        elif got[0] != reference[p]:
            report.wrong += 1
            report.problems.append(
                f"batch line-{i} {batch_result.get('jobs', {}).get(f'line-{i}')}: text differs from the undisturbed"
                f" run's: got {got[0]!r}, expected {reference[p]!r}"
            )
    report.requests += len(batch_prompts)
    report.http_5xx, report.http_503_refusals_retried = tally.http_5xx, tally.http_503
    report.balancer_errors = tally.balancer
    report.problems += tally.errors[:20]
    db.dispose()
    return report


# -- the schedule -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """One row of the schedule. `name`: `--only`'s word for it; `label`: its line in the log and the
    report; `action`: what `Injector` does (its method of that name), `how` (the signal sent, or how
    Redis refuses writes), and `away_s`: how long what it stops stays away before it starts again.
    `long`: the full run's only (or asked for with `--only`), never CI's short run."""

    name: str
    label: str
    action: str
    how: str = ""
    away_s: float = 0.0
    long: bool = False


# Spread among the others, `--worker-kills` times (3 in the short run, 20 in the full one).
WORKER_KILL = Fault("worker", "worker SIGKILL", "kill_worker", "SIGKILL")
FAULTS: tuple[Fault, ...] = (
    Fault("redis", "redis SIGKILL + restart empty", "redis_away", away_s=2),
    Fault("postgres", "postgres stop -m immediate + restart", "postgres_away", away_s=3),
    Fault("api", "api SIGTERM", "signal_api", "SIGTERM"),
    Fault("api", "api SIGKILL", "signal_api", "SIGKILL"),
    Fault("dispatcher", "dispatcher SIGKILL", "kill_dispatcher", "SIGKILL", away_s=1),
    # Longer than the API's 5 s key cache and redis-py's retry window.
    Fault(
        "redis-30s",
        f"redis-30s away {LONG_OUTAGE_S:.0f} s (SIGKILL, restarted empty)",
        "redis_away",
        away_s=LONG_OUTAGE_S,
        long=True,
    ),
    Fault(
        "postgres-30s",
        f"postgres-30s away {LONG_OUTAGE_S:.0f} s (stop -m immediate, restart)",
        "postgres_away",
        away_s=LONG_OUTAGE_S,
        long=True,
    ),
    Fault(
        "redis-oom",
        f"redis-oom refuses writes {LONG_OUTAGE_S:.0f} s (maxmemory 1, noeviction)",
        "redis_refuses",
        "oom",
        LONG_OUTAGE_S,
        long=True,
    ),
    Fault(
        "redis-misconf",
        f"redis-misconf refuses writes {LONG_OUTAGE_S:.0f} s (a failed snapshot)",
        "redis_refuses",
        "misconf",
        LONG_OUTAGE_S,
        long=True,
    ),
)
ONLY = tuple(dict.fromkeys(f.name for f in FAULTS))  # what `--only` may name, in the table's order


def schedule(
    short: bool, worker_kills: int | None = None, only: set[str] | None = None, rounds: int = 1
) -> list[Fault]:
    """The faults of one run, in order: the table's (CI's short run keeps to the brief outages;
    `only`: those it names, `rounds` times over) with the worker kills spread among them, half of
    them after the first two."""
    kills = worker_kills if worker_kills is not None else (3 if short else 20)
    others = [f for f in FAULTS if not f.long or not short or only is not None]
    if only is not None:
        others = [f for f in others if f.name in only] * max(1, rounds)
    return [WORKER_KILL] * (kills // 2) + others[:2] + [WORKER_KILL] * (kills - kills // 2) + others[2:]


# How long a kill waits for work to cut. Long: beside the test shards (a machine shared with other
# stacks) a stream may still be waiting out the lease of the worker killed just before, and the kill
# must still cut one mid-flight (20 s failed once in four runs there, 2026-11-28).
KILL_WAIT_S = 90.0


class Injector:
    """What each fault of the table does (`Fault.action`) to the one-host stack."""

    def __init__(self, st: Stack, pg: OwnPostgres, rd: OwnRedis, db: Any, report: Report, n_tokens: int) -> None:
        self.st, self.pg, self.rd, self.db, self.report, self.n_tokens = st, pg, rd, db, report, n_tokens

    def run(self, fault: Fault) -> None:
        getattr(self, fault.action)(fault)

    def _running_jobs(self) -> int:
        from sqlalchemy import text

        with self.db.connect() as conn:
            return conn.scalar(text("SELECT count(*) FROM jobs WHERE state = 'running'")) or 0

    def _streaming_jobs(self) -> int:
        """Streams mid-flight: started a while ago and less than half written (the stream's own
        length, from Redis), so a kill that follows cuts one rather than landing after its end."""
        import redis as redis_lib
        from sqlalchemy import text

        from core.infra.streams.keys import stream_key

        with self.db.connect() as conn:
            q = (
                "SELECT id FROM jobs WHERE state = 'running' AND kind = 'interactive' AND stream"
                " AND started_at < now() - interval '100 milliseconds'"  # its first chunks are out
            )
            ids = list(conn.scalars(text(q)))
        try:
            with redis_lib.Redis.from_url(self.rd.url) as r:
                return sum(1 for i in ids if 0 < r.xlen(stream_key(i)) < self.n_tokens // 2)
        except redis_lib.RedisError:
            return 0

    def kill_worker(self, f: Fault) -> None:
        try:
            wait_for(self._running_jobs, KILL_WAIT_S, "a job mid-generation")
        except TimeoutError:
            self.report.problems.append("no job was running when a worker kill was due")
        self.st.signal("worker", signal.Signals[f.how])
        self.st.start_worker()

    def redis_away(self, f: Fault) -> None:
        self.rd.kill()
        time.sleep(f.away_s)
        self.rd.start()

    def postgres_away(self, f: Fault) -> None:
        self.pg.stop("immediate")
        time.sleep(f.away_s)
        self.pg.start()

    def redis_refuses(self, f: Fault) -> None:
        self.rd.refuse_writes(f.how, f.away_s)

    def signal_api(self, f: Fault) -> None:
        # Cut streams mid-flight, as the worker kills cut jobs mid-generation: a faster engine
        # finishes short streams before a blind kill lands, and then nothing re-attaches.
        try:
            wait_for(self._streaming_jobs, KILL_WAIT_S, "a stream mid-generation")
        except TimeoutError:
            self.report.problems.append("no stream was running when an API kill was due")
        self.st.signal("api", signal.Signals[f.how])
        self.st.start_api()

    def kill_dispatcher(self, f: Fault) -> None:
        self.st.signal("dispatcher", signal.Signals[f.how])
        time.sleep(f.away_s)
        self.st.start("dispatcher", "dispatcher")


def _load_and_faults(
    st: Stack,
    pg: OwnPostgres,
    rd: OwnRedis,
    key: str,
    rng: random.Random,
    short: bool,
    worker_kills: int | None,
    report: Report,
    only: set[str] | None = None,
    rounds: int = 1,
) -> Report:
    """The one-host schedule (`schedule`: process kills, restarts and outages), under
    `load_and_audit`'s load."""
    from sqlalchemy import create_engine

    db = create_engine(pg.url, pool_pre_ping=True)
    injector = Injector(st, pg, rd, db, report, N_TOKENS)

    def inject() -> None:
        gap = 2.0 if short else 5.0  # between faults: the load goes on (each kill also waits for work in flight)
        time.sleep(gap)
        for fault in schedule(short, worker_kills, only, rounds):
            print(f"[{time.strftime('%H:%M:%S')}] fault: {fault.label}", flush=True)
            injector.run(fault)
            report.faults.append(fault.label)
            time.sleep(gap)

    try:
        return load_and_audit(st.base_url, key, pg.url, rng, short, report, inject, st.logdir / "history.jsonl")
    finally:
        db.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="3 worker kills instead of 20; shorter gaps (CI)")
    ap.add_argument("--worker-kills", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="with --only: repeat the chosen faults")
    ap.add_argument(
        "--only",
        default=None,
        help=f"comma-separated subset of: {', '.join(ONLY)}",
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    finish(run(args.short, args.worker_kills, args.workdir, only=only, rounds=args.rounds), args.json)


def finish(report: Report, json_path: Path | None) -> None:
    """Print the report (and write it to `json_path`); exit 0 only if it is clean. Shared by
    `python -m ops.faults` and `python -m ops.cluster`."""
    body = json.dumps(asdict(report), indent=2)
    print(body)
    if json_path:
        json_path.write_text(body)
    sys.exit(0 if report.clean else 1)


if __name__ == "__main__":
    main()
