"""Hostile scenarios against a full stack while other tenants stream (issue 25).

Each scenario attacks from tenant `beta` (or a 1-rpm tenant) while tenant `alpha` keeps streaming
completions; it reports alpha's inter-token gap p99 and TTFT p99, the API's and the worker's RSS
growth over idle, and every 5xx seen anywhere. Run: `python -m ops.hostile [scenario ...]` with
SPOOL_TEST_DATABASE_URL / SPOOL_TEST_REDIS_URL naming a database and Redis db of your own.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import TEST_DB, TEST_REDIS, Stack, running_stack
from tests.sse import events


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else (xs[0] if xs else 0.0)


@dataclass
class Victims:
    """Tenant alpha streaming completions back to back on `n` threads until stopped."""

    stack: Stack
    n: int = 2
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _one(self) -> None:
        body = {"model": "default", "prompt": "Tell me a story", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with self.stack.http(self.stack.keys["alpha"]) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        self.errors.append(r.status_code)
                        continue
                    last = None
                    for ev in events(r):
                        now = time.monotonic()
                        if ev.data == "[DONE]":
                            break
                        if last is None:
                            self.ttfts.append(now - t0)
                        else:
                            self.gaps.append(now - last)
                        last = now

    def __enter__(self) -> Victims:
        self._threads = [threading.Thread(target=self._one, daemon=True) for _ in range(self.n)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def poisoned_resume_ids(st: Stack, statuses: list[int]) -> None:
    with st.http(st.keys["beta"]) as http:
        own = http.post("/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 2}).json()["id"]
        for _ in range(20):
            for bad in ("99999999999999999999-0", "²", "\u0661\u0662-\u0660"):
                r = http.get(f"/v1/jobs/{own}/events", headers={b"Last-Event-ID": bad.encode()})
                statuses.append(r.status_code)
            time.sleep(0.3)


def max_penalty_windows(st: Stack, statuses: list[int]) -> None:
    body = {
        "model": "default",
        "prompt": "Repeat after me",
        "max_tokens": 64,
        "repeat_last_n": 2**31 - 1,
        "repetition_penalty": 1.3,
        "frequency_penalty": 1.0,
        "n": 2,
    }
    with st.http(st.keys["beta"]) as http:
        for _ in range(6):
            statuses.append(http.post("/v1/completions", json=body).status_code)


def big_bodies_from_a_1rpm_key(st: Stack, statuses: list[int]) -> None:
    key = st.new_tenant(f"slow{int(time.time())}", rpm=1)
    prompt = "x " * (4 << 20)  # 8 MiB
    with st.http(key) as http:
        for _ in range(8):
            r = http.post("/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 1})
            statuses.append(r.status_code)


def upload_bomb(st: Stack, statuses: list[int]) -> None:
    with st.http(st.keys["beta"]) as http:
        blob = b'{"custom_id": "x"}\n' * (3 << 20)  # ~57 MiB of lines
        for _ in range(3):
            r = http.post("/v1/files", files={"file": ("bomb.jsonl", blob)}, data={"purpose": "batch"})
            statuses.append(r.status_code)


def _batch(http, lines: list[dict], window: str, webhook: str | None = None) -> str:
    blob = "\n".join(json.dumps(line) for line in lines).encode()
    r = http.post("/v1/files", files={"file": ("hostile.jsonl", blob)}, data={"purpose": "batch"})
    r.raise_for_status()
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/completions", "completion_window": window}
    if webhook:
        body["webhook_url"] = webhook
    b = http.post("/v1/batches", json=body)
    b.raise_for_status()
    return b.json()["id"]


def _line(i: int) -> dict:
    body = {"model": "default", "prompt": f"Line {i}", "max_tokens": 4}
    return {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body}


def huge_batch_one_second_window(st: Stack, statuses: list[int]) -> None:
    """20,000 lines whose window ends a second after submission: the keeper expires them through
    the lifecycle in slices (usage, settle, terminal event each) off the dispatcher's loop."""
    with st.http(st.keys["beta"]) as http:
        batch_id = _batch(http, [_line(i) for i in range(20_000)], "1s")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            r = http.get(f"/v1/batches/{batch_id}")
            statuses.append(r.status_code)
            if r.json()["status"] in ("expired", "completed", "failed", "cancelled"):
                return
            time.sleep(0.5)


def slow_header_webhook(st: Stack, statuses: list[int]) -> None:
    """Batches whose webhook receiver (127.0.0.1) accepts the connection and never answers: each
    delivery is cut at SPOOL_WEBHOOK_TIMEOUT_S on the webhook pool, never on an inference thread."""
    import socket

    held: list[socket.socket] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    stop = threading.Event()

    def accept_and_hold() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            held.append(conn)  # read nothing, answer nothing

    t = threading.Thread(target=accept_and_hold, daemon=True)
    t.start()
    try:
        with st.http(st.keys["beta"]) as http:
            ids = [_batch(http, [_line(i) for i in range(3)], "24h", f"http://127.0.0.1:{port}/hook") for _ in range(4)]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(held) < len(ids):
                for b in ids:
                    statuses.append(http.get(f"/v1/batches/{b}").status_code)
                time.sleep(0.5)
            time.sleep(5)  # the held deliveries reach their deadline while the victims stream
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        server.close()


SCENARIOS: dict[str, Callable[[Stack, list[int]], None]] = {
    "poisoned_resume_ids": poisoned_resume_ids,
    "max_penalty_windows": max_penalty_windows,
    "big_bodies_1rpm": big_bodies_from_a_1rpm_key,
    "upload_bomb": upload_bomb,
    "huge_batch_one_second_window": huge_batch_one_second_window,
    "slow_header_webhook": slow_header_webhook,
}


def run(st: Stack, name: str) -> dict:
    api, worker = st.procs["api"].pid, st.procs["worker"].pid
    idle = (rss_mib(api), rss_mib(worker))
    statuses: list[int] = []
    peak = list(idle)
    with Victims(st) as v:
        attack = threading.Thread(target=SCENARIOS[name], args=(st, statuses))
        attack.start()
        while attack.is_alive():
            peak = [max(peak[0], rss_mib(api)), max(peak[1], rss_mib(worker))]
            attack.join(0.2)
    return {
        "scenario": name,
        "gap_p99_s": round(p99(v.gaps), 3),
        "ttft_p99_s": round(p99(v.ttfts), 3),
        "victim_tokens": len(v.gaps) + len(v.ttfts),
        "api_rss_growth_mib": round(peak[0] - idle[0], 1),
        "worker_rss_growth_mib": round(peak[1] - idle[1], 1),
        "attacker_statuses": sorted(set(statuses)),
        "fivexx": sum(s >= 500 for s in statuses + v.errors),
    }


def main(names: list[str]) -> list[dict]:
    rows = []
    with running_stack(Path(tempfile.mkdtemp(prefix="hostile-")), TEST_DB, TEST_REDIS) as st:
        for name in names or list(SCENARIOS):
            rows.append(run(st, name))
            print(json.dumps(rows[-1]), flush=True)
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
