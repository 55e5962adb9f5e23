"""Issue 25: a big request body is decoded and validated off the API's event loop.

FastAPI used to parse and validate bodies on the loop: one 200k-message chat body (7 MB) or a
prompt of a million token ids held every other request of the process for ~0.4-0.7 s. Here one
client sends such bodies while another asks GET /health back to back, and the test looks at the
/health answers that arrive after a body's last byte was sent and before its answer came: the time
the server spent decoding and validating it (it is answered with a 404 for its model only after
validation). A loop busy parsing answers nothing for most of that window; a loop that hands the work
to a thread keeps answering. No speed is asserted: `python -m ops.hostile` measures the stalls."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator

from tests.conftest import Stack

# A loop that parses a body itself answers nothing until the parse ends: on 0ed3e16 (parsed on the
# loop) the /health answers of a window all came while the body's tail was still being read, then
# none for the rest of it. A loop that hands the parse to a thread keeps answering all through. The
# longest silence is taken as a share of its window, so a loaded machine (slower parses and slower
# answers alike) moves both sides of the ratio: CI saw 31-62 answers per window on a busy run where
# a quiet one sees 77-143, and a count threshold failed there although nothing stalled. Measured
# with this test side by side on a busy machine: 0ed3e16 0.82-0.93 of each window silent, today 0.06-0.19.
MAX_SILENT_SHARE = 0.5


def _bodies() -> list[tuple[str, bytes]]:
    chat = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}] * 200_000}
    tokens = {"model": "no-such-model", "prompt": list(range(1_000_000, 1_000_000 + 900_000))}
    text = {"model": "no-such-model", "prompt": "a " * ((4 << 20) - 64)}
    return [
        ("/v1/chat/completions", json.dumps(chat).encode()),
        ("/v1/completions", json.dumps(tokens).encode()),
        ("/v1/completions", json.dumps(text).encode()),
    ]


def test_big_bodies_do_not_stall_other_requests(stack: Stack):
    bodies = _bodies()
    assert all(len(raw) <= 8 << 20 for _, raw in bodies)  # inside the API's body limit
    answered: list[float] = []  # when each /health answer arrived
    stop = threading.Event()

    def heartbeat() -> None:
        with stack.http() as c:
            while not stop.is_set():
                assert c.get("/health").status_code == 200
                answered.append(time.perf_counter())

    windows: list[tuple[str, float, float]] = []
    with stack.http(stack.keys["alpha"]) as c:
        c.get("/health")  # connection up before the measurement
        probe = threading.Thread(target=heartbeat)
        probe.start()
        try:
            for _ in range(2):
                for path, raw in bodies:
                    sent: list[float] = []

                    def chunks(raw: bytes = raw, sent: list[float] = sent) -> Iterator[bytes]:
                        for i in range(0, len(raw), 1 << 20):
                            yield raw[i : i + (1 << 20)]
                        sent.append(time.perf_counter())  # httpx asks for more only after writing the last

                    r = c.post(path, content=chunks(), headers={"content-type": "application/json"})
                    done = time.perf_counter()
                    # validated in full, then refused for its model: the parse happened
                    assert r.status_code == 404, r.text[:500]
                    assert r.json()["error"]["code"] == "model_not_found"
                    windows.append((path, sent[0], done))
        finally:
            stop.set()
            probe.join()
    counts, silent = [], []
    for _, start, end in windows:
        inside = [t for t in answered if start < t < end]
        edges = [start, *inside, end]
        counts.append(len(inside))
        silent.append(max(b - a for a, b in itertools.pairwise(edges)) / (end - start))
    print(f"/health answers while each body was parsed: {counts}; longest silence, share of window: {silent}")
    # The 4 MiB string decodes in tens of ms either way: it is sent for its errors, not measured.
    measured = [
        (n, share) for n, share, (_, raw) in zip(counts, silent, bodies * 2, strict=True) if b'"a a a' not in raw[:64]
    ]
    assert all(n > 0 and share < MAX_SILENT_SHARE for n, share in measured), (
        f"the event loop stalled while big bodies were parsed: (answers, longest silence share) {measured}"
    )


def test_errors_of_big_and_bad_bodies_unchanged(stack: Stack):
    """The errors FastAPI gave for these bodies, now raised from the prepare thread."""
    cases = [
        (b"", "application/json", 400, None),
        (b"{not json", "application/json", 400, "invalid_json"),
        (b"\xff\xfe\xfa", "application/json", 400, None),
        (b'{"model": "m", "prompt": "x"}', "text/plain", 400, "invalid_type"),
        (b"[1, 2]", "application/json", 400, "invalid_type"),
        (b'{"model": "m", "prompt": [1, -2]}', "application/json", 400, None),
        (b'{"model": "m", "prompt": [1.5]}', "application/json", 400, None),
        (b'{"prompt": "x"}', "application/json", 400, "missing_parameter"),
        (b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", 400, "invalid_json"),
    ]
    with stack.http(stack.keys["alpha"]) as c:
        for raw, ctype, status, code in cases:
            r = c.post("/v1/completions", content=raw, headers={"content-type": ctype})
            assert r.status_code == status, (raw, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error", err
            if code is not None:
                assert err["code"] == code, (raw, err)
        r = c.post(
            "/v1/completions", content=b'{"model": "m", "prompt": [1.5]}', headers={"content-type": "application/json"}
        )
        assert r.json()["error"]["param"] == "prompt", r.text
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": 1}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
