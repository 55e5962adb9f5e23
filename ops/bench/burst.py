"""Where a burst's first token waits: simultaneous streams in front of the paced engine, timed by
stage from the jobs' own rows.

    python -m ops.bench.burst [--concurrency 64] [--waves 3] [--root .] [--api-workers 1] [--detail]

Starts the paced stack as `ops.bench.paced --stack` does, opens one keep-alive connection per stream
(raw sockets: an HTTP client library's own CPU, on the same 2 cores, would be inside the figures),
then sends waves of N streamed requests at once. For each wave, milliseconds from the first send:
- `stored`: the job's `created_at` (the API's intake: body, limits, the group-commit INSERT);
- `claimed`: its `started_at` (the Celery message reached a worker, which claimed the job);
- `headers`: the response's headers at the client;
- `first`: the first chunk with text at the client (TTFT; the engine's prefill and first step after
  the claim, then Redis, the API and the socket).
Each as min / p50 / max over the wave. Postgres's clock and this client's are the same machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from ops.bench.client import PROMPTS
from ops.bench.paced import ROOT, paced_stack

_TEXT = re.compile(rb'"text":"[^"]')
_ID = re.compile(rb'"id":"([^"]+)"')


@dataclass
class Timed:
    sent: float
    headers: float = 0.0
    first: float | None = None
    job_id: str | None = None
    stored: float | None = None
    claimed: float | None = None


async def _drain_response(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.I)
    if length:
        await reader.readexactly(int(length.group(1)))


async def _stream(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], host: str, key: str, prompt: str, max_tokens: int
) -> Timed:
    reader, writer = conn
    body = json.dumps(
        {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        | {"stream": True, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    t = Timed(sent=time.time())
    writer.write(head.encode() + body)
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    t.headers = time.time()
    seen = b""
    while not seen.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk, after [DONE]
        data = await reader.read(65536)
        if not data:
            break
        seen += data
        if t.first is None and _TEXT.search(seen):
            t.first = time.time()
        if t.job_id is None and (found := _ID.search(seen)):
            t.job_id = found.group(1).decode()
    return t


def _spread(values: list[float]) -> str:
    v = sorted(values)
    return f"{v[0]:7.1f} {statistics.median(v):7.1f} {v[-1]:7.1f}" if v else "      -"


async def run(
    root: Path, concurrency: int, waves: int, max_tokens: int, detail: bool = False, api_workers: int = 1
) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    with paced_stack(root, [concurrency], "spool_burst", api_workers) as (url, key, _, _, _):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(concurrency)]
        for r, w in conns:  # each connection up and used once before the clock
            w.write(f"GET /v1/models HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n\r\n".encode())
            await w.drain()
            await _drain_response(r)
        await asyncio.gather(*(_stream(conns[i], host, key, PROMPTS[i], 8) for i in range(8)))  # warm-up
        dsn = _dsn()
        for wave in range(waves):
            await asyncio.sleep(1)
            timed = await asyncio.gather(
                *(_stream(c, host, key, PROMPTS[i % len(PROMPTS)], max_tokens) for i, c in enumerate(conns))
            )
            with psycopg.connect(dsn) as db:  # a chunk's id is its job's id
                query = "SELECT id, extract(epoch from created_at), extract(epoch from started_at) FROM jobs"
                rows = db.execute(query + " WHERE id = ANY(%s)", ([t.job_id for t in timed if t.job_id],))
                stamps = {r[0]: (float(r[1]), float(r[2]) if r[2] else None) for r in rows}
            t0 = min(t.sent for t in timed)
            for t in timed:
                t.stored, t.claimed = stamps.get(t.job_id or "", (None, None))

            def ms(values: list[float | None], t0: float = t0) -> list[float]:
                return [(v - t0) * 1000 for v in values if v is not None]

            stages = {
                "sent": ms([t.sent for t in timed]),
                "stored": ms([t.stored for t in timed]),
                "claimed": ms([t.claimed for t in timed]),
                "headers": ms([t.headers for t in timed]),
                "first": ms([t.first for t in timed]),
            }
            print(f"wave {wave + 1}, {concurrency} streams, ms from the first send: min / p50 / max")
            for name, values in stages.items():
                print(f"  {name:8s} {_spread(values)}")
            if detail:  # each job in claim order: which engine step took it, and when its token came
                print(f"    stored claimed  first (ms from {t0:.4f})")
                for t in sorted(timed, key=lambda t: t.claimed or 0):
                    row = ms([t.stored, t.claimed, t.first])
                    print("   " + " ".join(f"{v:7.1f}" for v in row))
            out.append({f"{k}_p50": statistics.median(v) for k, v in stages.items() if v})
    return out


def _dsn() -> str:
    """The database paced_stack made (on the test database's server), for psycopg."""
    from ops import harness

    return "postgresql://" + harness.TEST_DB.split("://", 1)[1].rsplit("/", 1)[0] + "/spool_burst"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose stack runs")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--detail", action="store_true", help="also print each job's stages, in claim order")
    ap.add_argument("--api-workers", type=int, default=1, help="the API as this many processes")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    waves = asyncio.run(run(root, args.concurrency, args.waves, args.max_tokens, args.detail, args.api_workers))
    print("medians over waves (ms):", {k: round(statistics.median(w[k] for w in waves), 1) for k in waves[0]})


if __name__ == "__main__":
    main()
