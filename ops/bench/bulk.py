"""Bulk work in front of the paced engine (issue 26): one Batches API batch vs the engine alone.

    python -m ops.bench.bulk --stack [--lines 2000 --max-tokens 64]    # starts its own paced stack
    python -m ops.bench.bulk --url URL --api-key KEY [--pids name=PID,...]

Reference first: the same lines (greedy, `ignore_eos`, seed 0) submitted at once to the paced engine
in-process (`EngineLoop`, the worker's own loop, built with this process's SPOOL_* settings: run it
with the stack's SPOOL_ENGINE=paced, SPOOL_MAX_BATCH, SPOOL_PACED_*), timed from the first submit
to the last token, with the exact figure for that many sequences beside it (`exact_seconds`: the
engine's step model with every slot kept full, prefill included). Then through Spool: the JSONL
uploaded with the `openai` SDK, the batch created and polled until it ends, timed from the create
call to the poll that saw `completed` (client side) and from `in_progress_at` to `completed_at`
(server side, whole seconds), with the CPU of each named process tree over the batch's run. Every
output line's text is checked against the engine's deterministic output for its prompt.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import queue
import time
import uuid
from collections.abc import Callable, Hashable
from pathlib import Path

from core.generation.params import GenerationParams
from workers.engine.base import SeqSpec, TokenEvent
from workers.engine.loop import EngineLoop
from workers.engine.paced import PacedEngine, step_seconds

MODEL = "smollm2-135m-instruct"
PACED_BATCH = 64  # the worker holds this many batch lines at once (paced_stack sizes its threads from it)


def prompts(n: int) -> list[str]:
    return [f"Line {i}: write a short note about the number {i}." for i in range(n)]


def exact_seconds(n: int, tokens: int, prompt_tokens: list[int], eng: PacedEngine) -> float:
    """The paced engine's own time for `n` sequences of `tokens` each, submitted at once: every step
    advances each live sequence one token, slots refill as sequences end, and each sequence first
    sleeps its prefill (`prompt tokens / prefill_tps`) as it starts."""
    slots = eng.max_batch
    total = sum(prompt_tokens) / eng.prefill_tps
    left = [tokens] * n
    live: list[int] = []
    i = 0
    while i < n or live:
        while len(live) < slots and i < n:
            live.append(i)
            i += 1
        total += step_seconds(len(live), eng.step_ms, eng.seq_ms)
        for j in live:
            left[j] -= 1
        live = [j for j in live if left[j] > 0]
    return total


def engine_alone(lines: list[str], max_tokens: int) -> tuple[float, float, dict[int, str], float]:
    """(measured seconds, exact seconds, text of each line, ms between steps) on the paced engine
    in-process. The last is the host's time between one step and the next (events, callbacks): the
    worker logs the same figure once a minute ("engine: ... between steps")."""
    from workers.runtime import build_engine

    loop = EngineLoop(make=lambda: build_engine(MODEL))  # on its own thread, as the worker does
    eng = loop.engine
    if not isinstance(eng, PacedEngine):
        raise SystemExit("run with SPOOL_ENGINE=paced (and the stack's SPOOL_MAX_BATCH, SPOOL_PACED_*)")
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    ids = [eng.tokenize(p) for p in lines]
    keys: dict[Hashable, int] = {uuid.uuid4().hex: i for i in range(len(lines))}
    toks: dict[int, list[int]] = {i: [] for i in range(len(lines))}
    start = time.perf_counter()
    loop.submit(
        [
            SeqSpec(key=k, prompt_ids=ids[i], max_new_tokens=max_tokens, params=params, seed=0, interactive=False)
            for k, i in keys.items()
        ],
        inbox.put,
    )
    ended = 0
    while ended < len(lines):
        ev = inbox.get()
        if not isinstance(ev, TokenEvent):
            continue
        if ev.token_id is not None:
            toks[keys[ev.key]].append(ev.token_id)
        ended += ev.ended
    took = time.perf_counter() - start
    texts = {i: b"".join(eng.token_bytes(t) for t in ts).decode("utf-8", "replace") for i, ts in toks.items()}
    between_ms = loop.between_s * 1000 / max(1, loop.steps)
    return took, exact_seconds(len(lines), max_tokens, [len(x) for x in ids], eng), texts, between_ms


def through_spool(
    url: str, api_key: str, lines: list[str], max_tokens: int, meters: dict[str, Callable[[], float]]
) -> dict:
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=3, timeout=120)
    body = "".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": MODEL,
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "seed": 0,
                },
            }
        )
        + "\n"
        for i, p in enumerate(lines)
    )
    f = client.files.create(file=("bulk.jsonl", io.BytesIO(body.encode())), purpose="batch")
    before = {k: m() for k, m in meters.items()}
    start = time.perf_counter()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    created = time.perf_counter() - start
    while b.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.1)  # the batch's end is seen within ~0.1 s (0.25 s before 2026-11-26)
        b = client.batches.retrieve(b.id)
    took = time.perf_counter() - start
    cpu = {k: m() - before[k] for k, m in meters.items()}
    texts: dict[int, str] = {}
    if b.output_file_id:
        for raw in client.files.content(b.output_file_id).text.splitlines():
            line = json.loads(raw)
            texts[int(line["custom_id"].split("-")[1])] = line["response"]["body"]["choices"][0]["text"]
    server = None
    if b.in_progress_at and b.completed_at:
        server = b.completed_at - b.in_progress_at
    return {
        "status": b.status,
        "seconds": took,
        "create_call_s": created,
        "server_seconds": server,
        "counts": b.request_counts,
        "cpu": cpu,
        "texts": texts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stack", action="store_true", help="start a paced stack (ops.bench.paced.paced_stack)")
    ap.add_argument("--url")
    ap.add_argument("--api-key")
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pids", default="", help="name=PID,... process trees whose CPU is measured")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from ops.bench.paced import PACED_ENV, ROOT, paced_stack, tree_meter

    if a.stack:
        os.environ.update(PACED_ENV)  # the engine alone runs in this process with the worker's settings
        from core.config import Settings

        held = PACED_BATCH + Settings().prefetch_for(PACED_BATCH)  # the worker's threads: every line it may hold
        with paced_stack(ROOT, [held], "spool_bulk") as (url, key, meters, _pids, _calls):
            out = run(url, key, a.lines, a.max_tokens, meters)
    else:
        if not (a.url and a.api_key):
            ap.error("--url and --api-key, or --stack")
        meters = {k: tree_meter(int(v)) for k, v in (x.split("=") for x in a.pids.split(",") if x)}
        out = run(a.url, a.api_key, a.lines, a.max_tokens, meters)
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


def run(url: str, api_key: str, n: int, max_tokens: int, meters: dict[str, Callable[[], float]]) -> dict:
    lines = prompts(n)
    alone, exact, want, between_ms = engine_alone(lines, max_tokens)
    got = through_spool(url, api_key, lines, max_tokens, meters)
    texts = got.pop("texts")
    tokens = n * max_tokens
    out = {
        "lines": n,
        "max_tokens": max_tokens,
        "engine_alone_s": round(alone, 2),
        "engine_exact_s": round(exact, 2),
        "engine_alone_ms_between_steps": round(between_ms, 3),
        "spool_s": round(got["seconds"], 2),
        "spool_server_s": got["server_seconds"],
        "create_call_s": round(got["create_call_s"], 3),
        "spool_vs_exact": round(exact / got["seconds"], 3),
        "spool_vs_engine_alone": round(alone / got["seconds"], 3),
        "status": got["status"],
        "counts": got["counts"].model_dump() if got["counts"] is not None else None,
        "texts_equal": sum(texts.get(i) == want[i] for i in range(n)),
        "cpu_ms_per_line": {k: round(v * 1000 / n, 3) for k, v in got["cpu"].items()},
        "cpu_ms_per_token": {k: round(v * 1000 / tokens, 4) for k, v in got["cpu"].items()},
    }
    return out


if __name__ == "__main__":
    main()
