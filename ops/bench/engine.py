"""`spool bench --mode engine`: the same prompts run straight on the engine loop, in-process.

No API, no Postgres, no Celery, no Redis: what the engine alone achieves, to divide Spool's
numbers by. Called as `python -m ops.bench.engine CONFIG_JSON`; prints the summaries as JSON.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import uuid

from core.generation.params import GenerationParams
from ops.bench.client import BenchConfig, RequestResult, Summary, summarize, to_json
from workers.engine.base import SeqSpec, TokenEvent
from workers.engine.loop import EngineLoop
from workers.engine.paced import PacedEngine, analytic_tok_s


def _client(loop: EngineLoop, cfg: BenchConfig, todo: queue.SimpleQueue, out: list[RequestResult]) -> None:
    params = GenerationParams(**cfg.sampling(), ignore_eos=cfg.ignore_eos, seed=cfg.seed)
    while True:
        try:
            prompt = todo.get_nowait()
        except queue.Empty:
            return
        start = time.perf_counter()
        ids = loop.engine.tokenize(prompt)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        loop.submit(
            [
                SeqSpec(
                    key=uuid.uuid4().hex, prompt_ids=ids, max_new_tokens=cfg.max_tokens, params=params, seed=cfg.seed
                )
            ],
            inbox.put,
        )
        first = last = None
        n = 0
        while True:
            ev = inbox.get()
            if not isinstance(ev, TokenEvent):
                continue
            if ev.token_id is not None:
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
            if ev.ended:
                break
        end = time.perf_counter()
        ok = ev.error is None
        out.append(
            RequestResult(
                ok,
                ttft=(first - start) if first else None,
                itl=(last - first) / (n - 1) if n > 1 and first is not None and last is not None else None,
                e2e=end - start,
                output_tokens=n,
                error=ev.error,
            )
        )


def _label(loop: EngineLoop, conc: int) -> str:
    """The paced engine's exact decode rate at this concurrency, printed beside what it achieved."""
    eng = loop.engine
    if isinstance(eng, PacedEngine):
        live = min(conc, eng.max_batch + eng.reserved)
        return f"engine (paced, exact {analytic_tok_s(live, eng.step_ms, eng.seq_ms):.0f} tok/s decode)"
    return "engine"


def measure(loop: EngineLoop, cfg: BenchConfig) -> list[Summary]:
    """Every concurrency level of `cfg` on a running engine loop (also the GPU proof kit's bench)."""
    summaries = []
    for conc in cfg.concurrency:
        todo: queue.SimpleQueue[str] = queue.SimpleQueue()
        for p in cfg.prompts():
            todo.put(p)
        results: list[RequestResult] = []
        threads = [threading.Thread(target=_client, args=(loop, cfg, todo, results)) for _ in range(conc)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        summaries.append(summarize(_label(loop, conc), "engine", cfg, conc, results, time.perf_counter() - start))
    return summaries


def main(raw: str) -> None:
    # Imported here: the worker's wiring (settings, database, Redis clients) is not needed to measure
    # an engine built otherwise (ops/gpu_proof/steps.py builds it on a machine without them).
    from workers.runtime import build_engine

    logging.basicConfig(level=logging.WARNING)
    cfg = BenchConfig.model_validate_json(raw)
    loop = EngineLoop(make=lambda: build_engine(cfg.model))  # on its own thread, as the worker does
    print(json.dumps(to_json(measure(loop, cfg))))


if __name__ == "__main__":
    main(sys.argv[1])
