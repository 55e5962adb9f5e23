"""Helpers more than one test module needs, written once: an API process answering, another API
process beside a stack's, a TCP proxy that can hang up, a tenant's rows, an async submission, a batch file,
`.env.example` read as compose reads it, a spy on the threads a function runs on, an engine loop's
events drained, and a Responses API job row. Nothing of Spool's is stood in for here."""

from __future__ import annotations

import json
import queue
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import jsonschema
import pytest
from sqlalchemy import text

from core.protocol import responses as wire
from tests.conftest import MODEL, ROOT, SPOOL, Stack, free_port, wait_for
from workers.engine.base import TokenEvent

# -- API processes -------------------------------------------------------------------------------


def answers_health(base_url: str, timeout: float = 2) -> bool:
    """The API at `base_url` answers /health (a refused or timed-out connection: not yet)."""
    try:
        return httpx.get(base_url + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def api_replica(stack: Stack, name: str, **env: str) -> tuple[str, subprocess.Popen]:
    """Another API process of `stack` (`spool api --port P`, named `name`, `env` over the stack's),
    once it answers: (its base URL, the process). The caller ends it."""
    port = free_port()
    proc = stack.start(name, "api", "--port", str(port), env=env)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: answers_health(url), 60, f"API replica {name}")
    return url, proc


@contextmanager
def two_process_api(stack: Stack, **env: str) -> Iterator[str]:
    """`spool api --workers 2` on a port of its own, on the stack's environment (`env` over it) but
    for PROMETHEUS_MULTIPROC_DIR, logging to api2.log; yields its base URL once it answers."""
    port = free_port()
    env = {**stack.env, "SPOOL_API_PORT": str(port), **env}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = open(stack.logdir / "api2.log", "ab")
    proc = subprocess.Popen([*SPOOL, "api", "--workers", "2"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers_health(base), 60, "api --workers 2")
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def submit_async(http: httpx.Client, **body: Any) -> dict[str, Any]:
    """POST /v1/completions of `body` (the model: MODEL) with `Prefer: respond-async`: the job object
    answered, with its 202 and its Location checked."""
    r = http.post("/v1/completions", headers={"Prefer": "respond-async"}, json={"model": MODEL, **body})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["object"] == "job" and r.headers["location"] == f"/v1/jobs/{job['id']}"
    return job


def batch_file(url: str, bodies: dict[str, dict[str, Any]]) -> bytes:
    """A Batch API input file: a line per custom id, a POST of its body to `url`, each line ended."""
    lines = [{"custom_id": custom_id, "method": "POST", "url": url, "body": body} for custom_id, body in bodies.items()]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def tenant_rows(db: Any, tenant: str, table: str, columns: str, tail: str = "") -> list[dict[str, Any]]:
    """`SELECT columns FROM table x` (then `tail`) over the rows of the tenant named `tenant`, as dicts."""
    sql = f"SELECT {columns} FROM {table} x JOIN tenants t ON t.id = x.tenant_id WHERE t.name = :n {tail}"
    with db.connect() as conn:
        return [dict(r) for r in conn.execute(text(sql), {"n": tenant}).mappings()]


# -- a TCP proxy ---------------------------------------------------------------------------------

Relay = Callable[[socket.socket, socket.socket], None]


def close(*socks: socket.socket) -> None:
    """Shut down and close each socket; one already gone is no error."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def pipe(src: socket.socket, dst: socket.socket, drop: bool = False) -> None:
    """Copy `src` to `dst` until either ends, then close both. `drop`: hang up as soon as `src`
    sends anything, forwarding none of it."""
    try:
        while data := src.recv(65536):
            if drop:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        close(src, dst)


@contextmanager
def tcp_proxy(host: str, port: int, relays: Callable[[int], tuple[Relay, Relay]]) -> Iterator[int]:
    """A TCP proxy to host:port on a local port of its own (yielded). Its n-th connection (from 0) is
    dialled through to the target, and `relays(n)` gives the two functions, each run on a thread of
    its own, that carry it: (client, upstream) one way, (upstream, client) the other."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def serve() -> None:
        n = 0
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((host, port))
            to_upstream, to_client = relays(n)
            n += 1
            threading.Thread(target=to_upstream, args=(client, upstream), daemon=True).start()
            threading.Thread(target=to_client, args=(upstream, client), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


# -- files, spies, engine loops, fake rows (no services) ------------------------------------------


def env_example() -> dict[str, str]:
    """`.env.example`'s settings, as compose reads the file (comments and blank lines skipped)."""
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def threads_of(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> list[int]:
    """Wrap `module.name` (for the test) so that it records the thread of every call; the list it
    fills. The function itself still runs: a spy, not a stand-in."""
    seen: list[int] = []
    real = getattr(module, name)

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


def drain(q: queue.SimpleQueue, keys: set, timeout: float = 30) -> dict:
    """Every TokenEvent of `keys` an engine loop put on `q`, by key, until each has ended (all of
    them within `timeout` seconds)."""
    got: dict = {k: [] for k in keys}
    open_ = set(keys)
    deadline = time.monotonic() + timeout
    while open_:
        ev = q.get(timeout=max(deadline - time.monotonic(), 0.01))
        if isinstance(ev, TokenEvent):
            got[ev.key].append(ev)
            if ev.ended:
                open_.discard(ev.key)
    return got


T0 = datetime(2025, 1, 1, tzinfo=UTC)


def response_job(
    state: str,
    result: dict[str, Any] | None,
    usage: dict[str, Any] | None,
    *,
    error: dict[str, Any] | None = None,
    tools: bool = False,
    **body: Any,
) -> Any:
    """A job row as the Responses API's renderers read it: the chat job of a response to `body`
    (`input: "Hi"` unless given), created, started and ended at T0."""
    req = wire.ResponsesRequest.model_validate({"model": MODEL, "input": "Hi", **body})
    return SimpleNamespace(
        id="cmpl-0123456789abcdef01234567",
        model=MODEL,
        state=state,
        attempt=1,
        params={},
        chat={"tools": tools, "top_logprobs": None, "response": wire.meta(req)},
        result=result,
        usage=usage,
        error=error,
        created_at=T0,
        started_at=T0,
        finished_at=T0,
    )


# -- request parts -----------------------------------------------------------------------------------
# A function tool and a strict JSON schema, for the chat tests on the wire (tests/e2e/test_chat.py) and
# their 50-sample counterparts in-process (tests/integration/test_constrained_samples.py).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


# Constraints of /v1/completions, and what a text each lets finish must be: on the wire in
# tests/e2e/test_protocol.py, 100 samples each in-process in tests/integration/test_constrained_samples.py.
NAME_AGE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def matches_schema(text: str, schema: dict[str, Any] = NAME_AGE) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


_REGEX = r"[0-9]{3}-[a-z]{2,5}"
_COLOURS = ["red", "green", "blue"]
# A GBNF grammar with both quoting styles of literals (llama.cpp's single-quoted ones included).
_GBNF = "root ::= num op num\nop ::= '+' | \"-\"\nnum ::= [0-9] | [1-9][0-9]"
CONSTRAINTS: dict[str, tuple[dict[str, Any], Callable[[str], bool]]] = {
    "regex": ({"regex": _REGEX}, lambda t: re.fullmatch(_REGEX, t) is not None),
    "guided_choice": ({"guided_choice": _COLOURS}, lambda t: t in _COLOURS),
    "gbnf": (
        {"grammar": _GBNF},
        lambda t: re.fullmatch(r"(?:[0-9]|[1-9][0-9])[+-](?:[0-9]|[1-9][0-9])", t) is not None,
    ),
    "json_schema": ({"json_schema": NAME_AGE}, matches_schema),
}
