"""A small, strict SSE reader for tests (so we check the wire format ourselves)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)


def events(resp: httpx.Response) -> Iterator[Event]:
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


def collect(resp: httpx.Response) -> tuple[list[Event], bool]:
    """All events up to `[DONE]`; the flag says whether `[DONE]` came."""
    out: list[Event] = []
    for ev in events(resp):
        if ev.data == "[DONE]":
            return out, True
        out.append(ev)
    return out, False
