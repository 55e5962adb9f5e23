"""A small, strict SSE reader for tests (so we check the wire format ourselves): ops/harness.py's,
shared with the fault harness, and `collect`."""

from __future__ import annotations

import httpx

from ops.harness import Event, events

__all__ = ["Event", "collect", "events"]


def collect(resp: httpx.Response) -> tuple[list[Event], bool]:
    """All events up to `[DONE]`; the flag says whether `[DONE]` came."""
    out: list[Event] = []
    for ev in events(resp):
        if ev.data == "[DONE]":
            return out, True
        out.append(ev)
    return out, False
