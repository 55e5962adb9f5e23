"""The process harness the tests (tests/conftest.py, tests/sse.py) and the fault harness
(ops/faults.py) share: a free port, waiting on a condition, and a strict SSE reader (so the wire
format is checked by our own code, not a client's)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.2,
    tolerate: tuple[type[BaseException], ...] = (),
) -> Any:
    """The predicate's first truthy value, polled every `interval`; TimeoutError naming `what`.
    `tolerate`: exceptions that count as "not yet" (a service still starting, or restarting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except tolerate:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)


def events(resp: httpx.Response) -> Iterator[Event]:
    """Server-sent events as the spec reads them: `data:` lines joined, one leading space dropped,
    comments (`:` keep-alives) skipped, an event dispatched at a blank line."""
    ev_id: str | None = None
    data: list[str] = []
    for line in resp.iter_lines():
        if line == "":
            if data:
                yield Event(ev_id, "\n".join(data))
            ev_id, data = None, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "id":
                ev_id = value
    if data:
        yield Event(ev_id, "\n".join(data))
