"""A fixed reference workload, timed in the same sitting as a benchmark, so that CPU costs can be
compared across sittings and machines (issue 39): these VMs vary up to 1.6x between sittings, and a
cost divided by the yardstick of its own sitting varies much less.

The workload is the kind of work Spool's own processes do per request and per token, in pure Python
on one thread: build an OpenAI-style chunk, encode it as JSON, parse it back, frame it as an SSE
event and hash an id. `measure()` returns the CPU milliseconds of one pass (the median of a few);
a cost in yardstick units (`yu`) is `cost_ms / (yardstick_ms / 1000)`: 1 yu is a thousandth of a pass.

    python -m ops.bench.yardstick          # prints this sitting's yardstick, ms of CPU per pass
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time

ROUNDS = 5
CHUNKS = 10_000  # ~100 ms of CPU per pass on the 2-core development VM (1 yu ~ 0.1 ms)


def _pass() -> int:
    out = 0
    for i in range(CHUNKS):
        chunk = {
            "id": f"cmpl-{i:08d}",
            "kind": "chunk",  # the shape of a completion chunk, not one (render builds those)
            "created": 1_764_000_000 + i,
            "model": "smollm2-135m-instruct",
            "choices": [{"index": 0, "text": f" token{i % 97}", "logprobs": None, "finish_reason": None}],
        }
        body = json.dumps(chunk, separators=(",", ":"))
        back = json.loads(body)
        frame = f"id: 0-{i}\ndata: {body}\n\n".encode()
        out += len(frame) + len(back["choices"][0]["text"]) + hashlib.sha1(frame).digest()[0]
    return out


def measure(rounds: int = ROUNDS) -> float:
    """CPU milliseconds of one pass, the median of `rounds` (a first pass warms up, uncounted)."""
    _pass()
    times = []
    for _ in range(rounds):
        t = time.process_time()
        _pass()
        times.append(1000 * (time.process_time() - t))
    return statistics.median(times)


def in_units(cost_ms: float, yardstick_ms: float) -> float:
    """A CPU cost in yardstick units (thousandths of a pass) of its sitting."""
    return cost_ms / (yardstick_ms / 1000)


if __name__ == "__main__":
    print(f"yardstick: {measure():.1f} ms of CPU per pass")
